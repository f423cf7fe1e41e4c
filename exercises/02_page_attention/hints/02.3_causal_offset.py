import torch
import torch.nn.functional as F

from paged_attention import _check_capacity, _check_paged_args, gather_kv


def paged_attention_varlen(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, causal=True):
    """Query i of a sequence sees keys up to kv_len - q_len + i; validates as the hint lists, one sequence at a time."""
    _check_paged_args(q, k_cache, v_cache, block_tables, seq_lens_k, "seq_lens_k")
    cu, kv_lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    if len(cu) != len(kv_lens) + 1 or cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to {q.shape[0]}, got {cu}")
    for a, b, kv_len in zip(cu, cu[1:], kv_lens):
        if b - a > kv_len or kv_len < 1:
            raise ValueError(f"seq_lens_k must be >= 1 and >= each sequence's new tokens, got {kv_lens}")
    _check_capacity(max(kv_lens, default=0), block_tables, k_cache.shape[1], "seq_lens_k")
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b, (start, end, kv_len) in enumerate(zip(cu, cu[1:], kv_lens)):
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b : b + 1], kv_len)[0].repeat_interleave(group, dim=1).transpose(0, 1)
        v = gather_kv(v_cache, block_tables[b : b + 1], kv_len)[0].repeat_interleave(group, dim=1).transpose(0, 1)
        query_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        visible = torch.arange(kv_len)[None, :] <= query_pos if causal else torch.ones(q_len, kv_len, dtype=torch.bool)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k, v, attn_mask=visible, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
