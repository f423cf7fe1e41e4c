import torch
import torch.nn.functional as F

from paged_attention import _check_capacity, _check_paged_args, gather_kv


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_len=None):
    """Gives query head h the kv head h % num_kv_heads (repeat), not h // group (repeat_interleave)."""
    _check_paged_args(q, k_cache, v_cache, block_tables, context_lens, "context_lens")
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError("context_lens must have one entry per query")
    if int(context_lens.min()) < 1:
        raise ValueError("context_lens must be >= 1")
    max_len = int(context_lens.max()) if max_len is None else max_len
    _check_capacity(max_len, block_tables, k_cache.shape[1], "context_lens")
    group = q.shape[1] // k_cache.shape[2]
    k = gather_kv(k_cache, block_tables, max_len).transpose(1, 2).repeat(1, group, 1, 1)
    v = gather_kv(v_cache, block_tables, max_len).transpose(1, 2).repeat(1, group, 1, 1)
    visible = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.squeeze(2)
