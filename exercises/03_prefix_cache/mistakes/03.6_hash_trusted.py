def match_prefix(self, token_ids, extra_keys=None, cache_salt=None):
    """Walks the chain while each hash is cached, trusting the hash: a collision's other tokens count as a hit."""
    matched = []
    for block_hash, _tokens in self.compute_hash_chain(token_ids, extra_keys, cache_salt):
        cached = self._cache.get(block_hash)
        if cached is None:
            break
        self._cache.move_to_end(block_hash)
        matched.append(cached)
    num_cached_tokens = len(matched) * 16
    self._total_count += len(token_ids)
    self._hit_count += num_cached_tokens
    return matched, num_cached_tokens
