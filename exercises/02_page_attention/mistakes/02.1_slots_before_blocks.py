from paged_attention import cdiv


def gather_kv(cache, block_tables, max_len):
    """Flattens slots before blocks, so position p reads slot p // num_blocks of block p % num_blocks."""
    num_blocks = cdiv(max_len, cache.shape[1])
    table = block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)
    return cache[table].transpose(1, 2).flatten(1, 2)[:, :max_len]
