import torch
import torch.nn.functional as F

from paged_attention import _check_capacity, _check_paged_args, gather_kv, paged_attention_decode


def paged_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Masks with is_causal=True over cached context too: query i sees keys 0..i, not its kv_len - q_len + i."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    _check_paged_args(q, k_cache, v_cache, block_tables, seq_lens_k, "seq_lens_k")
    if cu_seqlens_q.dim() != 1:
        raise ValueError(f"cu_seqlens_q must be 1-D [batch + 1], got shape {tuple(cu_seqlens_q.shape)}")
    cu = cu_seqlens_q.tolist()
    kv_lens = seq_lens_k.tolist()
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if len(cu) != len(kv_lens) + 1 or cu[0] != 0 or cu[-1] != q.shape[0] or min(q_lens, default=0) < 0:
        raise ValueError(
            f"cu_seqlens_q must rise from 0 to the {q.shape[0]} query tokens in {len(kv_lens) + 1} entries, got {cu}"
        )
    if any(ql > kl for ql, kl in zip(q_lens, kv_lens)):
        raise ValueError("seq_lens_k must be >= each sequence's number of new tokens (cu_seqlens_q)")
    if min(kv_lens, default=1) < 1:
        raise ValueError(f"seq_lens_k must be >= 1 (a query needs a key to attend to), got {kv_lens}")
    _check_capacity(max(kv_lens, default=0), block_tables, k_cache.shape[1], "seq_lens_k")
    out = torch.empty_like(q)
    single = [b for b, ql in enumerate(q_lens) if ql == 1]
    if single:
        rows = torch.tensor([cu[b] for b in single], device=q.device)
        idx = torch.tensor(single, device=block_tables.device)
        out[rows] = paged_attention_decode(q[rows], k_cache, v_cache, block_tables[idx], seq_lens_k[idx], scale)
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len <= 1:
            continue
        # GQA as a broadcast: K/V [Hkv, 1, kv_len, D] expanded (no copy) over the G query heads of
        # each group ([Hkv, G, q_len, D]). With enable_gqa and a mask, a CPU falls back to SDPA's
        # math path, about 2x slower here.
        k = gather_kv(k_cache, block_tables[b : b + 1], kv_len)[0].transpose(0, 1).unsqueeze(1)
        v = gather_kv(v_cache, block_tables[b : b + 1], kv_len)[0].transpose(0, 1).unsqueeze(1)
        shape = (num_kv_heads, group, kv_len, head_dim)
        qs = q[cu[b] : cu[b + 1]].reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        # SDPA's is_causal aligns the mask top-left: right only when no context is cached.
        o = F.scaled_dot_product_attention(qs, k.expand(shape), v.expand(shape), is_causal=causal, scale=scale)
        out[cu[b] : cu[b + 1]] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim)
    return out
