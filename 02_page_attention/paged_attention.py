"""Attention over a paged KV cache, in plain torch.

A sequence's keys and values are not contiguous: token ``p`` lives in slot ``p % block_size`` of
physical block ``block_table[p // block_size]`` of ``k_cache``/``v_cache``
(``[num_blocks, block_size, num_kv_heads, head_dim]`` each, chapter 01). Attention therefore
starts with a *gather*: index the cache with the block table, and the blocks come back in
logical order, ready for ordinary attention.

Two entry points, the two shapes of work an engine has:

* :func:`paged_attention_decode` — one new query token per sequence. Every sequence is gathered
  into one padded batch and attended in a single ``scaled_dot_product_attention`` call, with a
  mask hiding each sequence's padding. No Python loop over sequences: this is the CPU engine's
  hot path.
* :func:`paged_attention_varlen` — any number of new tokens per sequence, packed back to back
  (``cu_seqlens_q``), with earlier context already in the cache. Query ``i`` of a sequence with
  ``q_len`` new tokens and ``kv_len`` cached + new tokens sits at absolute position
  ``kv_len - q_len + i`` and sees the keys at positions up to that one. This serves whole
  prompts, prompt chunks (chapter 06), prompts after a prefix-cache hit (chapter 03) and
  speculative verification (chapter 05). Rows with one new token are sent to the decode path in
  one batch; longer rows are attended one sequence at a time (a prefill is large enough that the
  loop costs nothing next to its matmuls, and padding a 2,000-token prompt to a batch of decodes
  would waste far more).

:func:`dense_attention_reference` is the textbook definition the tests compare everything with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from block_manager import cdiv


def _check_gqa(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}) for GQA")


def _check_paged_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    lens_name: str,
) -> None:
    """Shape and dtype checks that need no device-to-host copy (so CUDA graphs may capture them).

    Without them a one-row ``block_tables`` or ``lens`` would broadcast over the whole batch and
    every sequence would silently attend to the first one's context.
    """
    if k_cache.dim() != 4 or k_cache.shape[3] != q.shape[-1]:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, kv_heads, {q.shape[-1]}], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    _check_gqa(q.shape[1], k_cache.shape[2])
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_seqs = lens.shape[0] if lens.dim() == 1 else -1
    if lens.dim() != 1 or lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{lens_name} must be a 1-D int32/int64 tensor, got {lens.dtype} of shape {tuple(lens.shape)}")
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or block_tables.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"block_tables must be an int32/int64 [{num_seqs}, max_blocks] tensor (one row per "
            f"{lens_name} entry), got {block_tables.dtype} of shape {tuple(block_tables.shape)}"
        )


def _check_capacity(max_len: int, block_tables: torch.Tensor, block_size: int, lens_name: str) -> None:
    if max_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"{lens_name} reaches {max_len} tokens but block_tables has room for "
            f"{block_tables.shape[1]} blocks of {block_size}"
        )


def dense_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for one sequence, in float32, the definition itself.

    Args:
        q: ``[q_len, Hq, D]``, the last ``q_len`` positions of the sequence.
        k, v: ``[kv_len, Hkv, D]``, every position of the sequence (``kv_len >= q_len``).
        causal: query ``i`` (absolute position ``kv_len - q_len + i``) sees keys ``<=`` it.
    """
    q_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    _check_gqa(hq, hkv)
    scale = d**-0.5 if scale is None else scale
    group = hq // hkv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Read ``[B, max_len, Hkv, D]`` from a paged cache: blocks come back in logical order.

    Entries of ``block_tables`` past a sequence's blocks may hold anything (padding); they are
    clamped to a valid index here and hidden by the caller's length mask.
    """
    block_size = cache.shape[1]
    num_blocks = cdiv(max_len, block_size)
    table = block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)
    # index_select copies each block as one contiguous row; advanced indexing (cache[table])
    # copies element by element, about 6x slower on a CPU for bfloat16 blocks.
    gathered = cache.index_select(0, table.flatten()).view(*table.shape, *cache.shape[1:])  # [B, nb, bs, Hkv, D]
    return gathered.flatten(1, 2)[:, :max_len]


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole context in the paged cache.

    Args:
        q: ``[B, Hq, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` int, padded past each sequence's blocks.
        context_lens: ``[B]`` int, tokens each sequence attends to (the new one included).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_len: any upper bound of ``context_lens`` known on the host; ``None`` reads the
            maximum from ``context_lens``, a device-to-host sync that a CUDA graph cannot
            capture (chapter 07's graphs pass ``max_model_len``).

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
    _check_paged_args(q, k_cache, v_cache, block_tables, context_lens, "context_lens")
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"context_lens must have one entry per query ({q.shape[0]}), got {context_lens.shape[0]}")
    if not context_lens.is_cuda and q.shape[0] and int(context_lens.min()) < 1:
        # A CPU check only: on a GPU it would be a host sync, which CUDA graph capture forbids.
        raise ValueError(f"context_lens must be >= 1 (a query needs a key to attend to), got {context_lens.tolist()}")
    if max_len is None:
        max_len = int(context_lens.max())
    _check_capacity(max_len, block_tables, k_cache.shape[1], "context_lens")
    k = gather_kv(k_cache, block_tables, max_len).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, max_len).transpose(1, 2)
    visible = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    # GQA without enable_gqa: the G query heads sharing a kv head become G query *rows* of that
    # head ([B, Hkv, G, D] against [B, Hkv, L, D]); the length mask broadcasts over them. On a CPU
    # this is 1.3-3x faster than enable_gqa=True (bfloat16 gains most), with identical results.
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim),
        k,
        v,
        attn_mask=visible[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, num_q_heads, head_dim)


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
    """Packed new tokens of ``B`` sequences attending to their cached context and to each other.

    Args:
        q: ``[T, Hq, D]``, the new tokens of every sequence back to back.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, the new tokens already stored.
        cu_seqlens_q: ``[B+1]`` int, sequence ``b``'s queries are rows ``cu[b]:cu[b+1]`` of ``q``.
        seq_lens_k: ``[B]`` int, cached + new tokens of each sequence.
        block_tables: ``[B, max_blocks]`` int.
        scale: softmax scale.
        causal: mask keys after each query's absolute position.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
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
        if causal and q_len < kv_len:  # new tokens after cached context: an explicit offset mask
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(qs, k.expand(shape), v.expand(shape), attn_mask=mask, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, k.expand(shape), v.expand(shape), is_causal=causal, scale=scale)
        out[cu[b] : cu[b + 1]] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim)
    return out
