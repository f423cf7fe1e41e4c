from global_kv_pool import KVBlockCorrupt, deserialize_block


def fetch(self, block_hashes, block_token_ids, kv_cache, block_ids):
    """Copies chain block i into physical block i, not into block_ids[i], the block the caller allocated for it."""
    if not len(block_hashes) == len(block_token_ids) == len(block_ids):
        raise ValueError("block_hashes, block_token_ids and block_ids must have the same length")
    if not block_hashes:
        return 0
    shape = tuple(kv_cache[:, :, 0].shape)
    if not self.available:
        self._fault("the store failed recently")
        return 0
    try:
        values = self.backend.get_many([self.block_key(h) for h in block_hashes])
    except Exception as exc:
        self._store_failed(f"fetch failed ({exc})")
        return 0
    for i, (value, tokens) in enumerate(zip(values, block_token_ids)):
        if value is None:
            self._fault(f"block {i} vanished before fetch")
            return i
        try:
            kv = deserialize_block(value, shape, kv_cache.dtype, tuple(tokens))
        except KVBlockCorrupt as exc:
            self._fault(f"block {i} is invalid: {exc}")
            return i
        kv_cache[:, :, i].copy_(kv)
        self.num_fetched += 1
    return len(block_hashes)
