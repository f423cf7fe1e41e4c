import torch

from paged_attention import cdiv


def gather_kv(cache, block_tables, max_len):
    """Reads each sequence's blocks as one contiguous run starting at block_tables[b, 0]."""
    num_blocks = cdiv(max_len, cache.shape[1])
    first = block_tables[:, :1].long()
    table = (first + torch.arange(num_blocks, device=first.device)).clamp(0, cache.shape[0] - 1)
    return cache[table].flatten(1, 2)[:, :max_len]
