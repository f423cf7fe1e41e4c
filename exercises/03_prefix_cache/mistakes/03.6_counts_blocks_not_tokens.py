from prefix_cache_local import BLOCK_SIZE


def match_prefix(self, token_ids, extra_keys=None, cache_salt=None):
    """Adds hit blocks to the hit counter, where the statistics are in tokens."""
    matched = []
    for block_hash, tokens in self.compute_hash_chain(token_ids, extra_keys, cache_salt):
        cached = self._cache.get(block_hash)
        if cached is None or cached.token_ids != tokens:
            break  # the chain is broken: later blocks cannot be reused either
        self._cache.move_to_end(block_hash)
        matched.append(cached)
    num_cached_tokens = len(matched) * BLOCK_SIZE
    self._total_count += len(token_ids)
    self._hit_count += len(matched)
    return matched, num_cached_tokens
