from prefix_cache_local import BLOCK_SIZE


def match_prefix(self, token_ids, extra_keys=None, cache_salt=None):
    """Keeps walking after a miss and counts later cached blocks as hits, though the chain is broken."""
    matched = []
    for block_hash, tokens in self.compute_hash_chain(token_ids, extra_keys, cache_salt):
        cached = self._cache.get(block_hash)
        if cached is None or cached.token_ids != tokens:
            continue
        self._cache.move_to_end(block_hash)
        matched.append(cached)
    num_cached_tokens = len(matched) * BLOCK_SIZE
    self._total_count += len(token_ids)
    self._hit_count += num_cached_tokens
    return matched, num_cached_tokens
