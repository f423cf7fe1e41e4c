from block_manager import cdiv


def gather_kv(cache, block_tables, max_len):
    """Indexes the cache with the padded table as it stands: a -1 or out-of-range padding entry is read or crashes."""
    num_blocks = cdiv(max_len, cache.shape[1])
    table = block_tables[:, :num_blocks].long()
    return cache[table].flatten(1, 2)[:, :max_len]
