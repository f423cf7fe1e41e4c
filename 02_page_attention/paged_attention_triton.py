"""Paged attention as Triton kernels: online softmax straight over the block table.

The torch path (:mod:`paged_attention`) first *gathers* every sequence's K/V into a contiguous
padded tensor, then calls ordinary attention: simple, but it copies the whole context of every
sequence once per layer and per step. The kernels here read K/V where they lie. A program walks
its sequence's keys in tiles of ``BLOCK_N`` token positions; for each position ``p`` it looks up
``block_tables[seq, p // block_size]`` and reads slot ``p % block_size`` of that physical block.
Nothing is copied, and no score matrix longer than one tile ever exists, because the softmax is
computed *online* (running max ``m`` and running sum ``l``, rescaled as each tile arrives; the
chapter README derives it).

Two kernels, the same two entry points as the torch module, with the same signatures:

* :func:`paged_attention_decode_triton` — one query token per sequence; one program per
  (sequence, kv head) handles the whole GQA group of query heads that share that kv head, so each
  key and value is loaded once for the group.
* :func:`paged_attention_varlen_triton` — packed new tokens with cached context before them
  (prefill, prefill chunks, prefix-cache hits, speculative verification); one program per
  (tile of ``BLOCK_M`` queries, sequence, query head), causal in absolute positions.

Key tiles are decoupled from KV blocks (a tile may span several blocks, or part of one), so any
``block_size`` works, including ones smaller than the 16 rows ``tl.dot`` needs on a GPU. Without a
GPU the kernels run in Triton's interpreter when the process sets ``TRITON_INTERPRET=1`` before
importing this module (the test harness and the demo do): slow, exact, fine for the tiny shapes
of the tests.
"""

from __future__ import annotations

import torch

from block_manager import cdiv
from triton_setup import HAS_TRITON, INTERPRETED, tl, triton  # before any other triton import

# Triton's interpreter keeps bfloat16 as raw uint16 bits and its tl.dot multiplies those bits
# (triton-lang/triton#11584), so interpreted kernels compute in float32. On a GPU, 16-bit inputs
# go to the tensor cores as they are, accumulating in float32.

# Tile sizes: 16 is the smallest side tl.dot accepts on a GPU; larger key tiles mean fewer loop
# iterations (and, in the interpreter, fewer slow Python steps).
DECODE_BLOCK_N = 32
VARLEN_BLOCK_M = 16
VARLEN_BLOCK_N = 32


def _check_common(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    lens_name: str,
    num_seqs: int,
    max_len: int | None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, kv_heads, {q.shape[2]}], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[2]}) for GQA")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous last (head_dim) dimension")
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or block_tables.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"block_tables must be an int32/int64 [{num_seqs}, max_blocks] tensor, "
            f"got {block_tables.dtype} of shape {tuple(block_tables.shape)}"
        )
    if lens.shape != (num_seqs,) or lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{lens_name} must be an int32/int64 [{num_seqs}] tensor, got {lens.dtype} of shape {tuple(lens.shape)}"
        )
    if max_len is not None:
        # The caller's bound, known on the host: the block table is checked against it, the lengths
        # themselves are trusted (as flash-attn trusts them), and nothing is read back from the GPU.
        if cdiv(max_len, k_cache.shape[1]) > block_tables.shape[1]:
            raise ValueError(
                f"block_tables has {block_tables.shape[1]} columns, too few for max_seqlen_k "
                f"{max_len} at block_size {k_cache.shape[1]}"
            )
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # the value checks below copy to the host, which a CUDA graph capture forbids
    if num_seqs and int(lens.min()) < 1:
        raise ValueError(f"{lens_name} must be >= 1 for every sequence (a query needs a key to attend to)")
    if num_seqs and cdiv(int(lens.max()), k_cache.shape[1]) > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns, too few for {lens_name} "
            f"{int(lens.max())} at block_size {k_cache.shape[1]}"
        )


if HAS_TRITON:

    @triton.jit
    def _load_kv_tile(
        cache_ptr,
        block_tables_ptr,
        seq,
        kv_head,
        pos,
        valid,
        d,
        d_mask,
        stride_b,
        stride_t,
        stride_h,
        stride_bt,
        BLOCK_SIZE: tl.constexpr,
    ):
        # The paged read: position -> (physical block, slot in block) through the block table.
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = block[:, None] * stride_b + (pos % BLOCK_SIZE)[:, None] * stride_t + kv_head * stride_h + d[None, :]
        return tl.load(cache_ptr + offs, mask=valid[:, None] & d_mask[None, :], other=0.0)

    @triton.jit
    def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale, UPCAST: tl.constexpr):
        # One tile of keys and values folded into the rows' running softmax: max ``m_i``, denominator
        # ``l_i`` and weighted values ``acc``; ``visible`` says which keys each row of ``q`` may see.
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # fp32 accumulate
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # 0 on the first tile (m_i = -inf): nothing to rescale yet
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        out_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_ob,
        stride_oh,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx_len = tl.load(context_lens_ptr + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for start in range(0, ctx_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < ctx_len
            k = _load_kv_tile(
                k_cache_ptr,
                block_tables_ptr,
                seq,
                kv_head,
                pos,
                valid,
                d,
                d_mask,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_bt,
                BLOCK_SIZE,
            )
            v = _load_kv_tile(
                v_cache_ptr,
                block_tables_ptr,
                seq,
                kv_head,
                pos,
                valid,
                d,
                d_mask,
                stride_vb,
                stride_vt,
                stride_vh,
                stride_bt,
                BLOCK_SIZE,
            )
            # The group's query rows (padded to 16, tl.dot's minimum) against the tile's keys.
            m_i, l_i, acc = _online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, scale, UPCAST)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )

    @triton.jit
    def _paged_varlen_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        cu_seqlens_q_ptr,
        seq_lens_k_ptr,
        block_tables_ptr,
        out_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_ot,
        stride_oh,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        tile = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if tile * BLOCK_M >= q_len:  # the grid is sized for the longest sequence
            return
        kv_len = tl.load(seq_lens_k_ptr + seq)
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = kv_len - q_len + rows  # absolute positions: the cached context comes first
        d = tl.arange(0, D_PAD)
        d_mask = d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        hi = kv_len
        if CAUSAL:  # keys after this tile's last query are invisible to all of it: skip them
            hi = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_M)
        for start in range(0, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < kv_len
            k = _load_kv_tile(
                k_cache_ptr,
                block_tables_ptr,
                seq,
                kv_head,
                pos,
                valid,
                d,
                d_mask,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_bt,
                BLOCK_SIZE,
            )
            v = _load_kv_tile(
                v_cache_ptr,
                block_tables_ptr,
                seq,
                kv_head,
                pos,
                valid,
                d,
                d_mask,
                stride_vb,
                stride_vt,
                stride_vh,
                stride_bt,
                BLOCK_SIZE,
            )
            visible = valid[None, :]
            if CAUSAL:
                visible = visible & (pos[None, :] <= q_pos[:, None])
            # Key 0 is visible to every row, so after the first tile m_i is finite for all rows.
            m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale, UPCAST)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use paged_attention.paged_attention_decode / _varlen")


def _packed_heads(q: torch.Tensor) -> torch.Tensor:
    # The kernels index q as base + token * stride(0) + head * stride(1) + d: d must be unit-stride.
    return q if q.stride(2) == 1 else q.contiguous()


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its paged context; same contract as
    :func:`paged_attention.paged_attention_decode`.

    Args:
        q: ``[B, Hq, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` int; entries past a sequence's blocks are never read.
        context_lens: ``[B]`` int, tokens each sequence attends to (the new one included), ``>= 1``.
        scale: softmax scale.
        max_seqlen_k: an upper bound of ``context_lens`` known on the host, as the engine's batch
            builder knows it. Given, the call reads nothing back from the device (every decode
            step, every layer); omitted, ``context_lens`` is checked, a device-to-host copy.

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype. Launches ``B × Hkv`` programs.
    """
    _require_triton()
    num_seqs = q.shape[0] if q.dim() == 3 else 0
    _check_common(q, k_cache, v_cache, block_tables, context_lens, "context_lens", num_seqs, max_seqlen_k)
    q = _packed_heads(q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        float(scale),
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=DECODE_BLOCK_N,
        UPCAST=INTERPRETED,
    )
    return out


def paged_attention_varlen_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Packed new tokens attending to their cached context and to each other; same contract as
    :func:`paged_attention.paged_attention_varlen`.

    Args:
        q: ``[T, Hq, D]``, the new tokens of every sequence back to back.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, the new tokens already stored.
        cu_seqlens_q: ``[B+1]`` int, sequence ``b``'s queries are rows ``cu[b]:cu[b+1]`` of ``q``.
        seq_lens_k: ``[B]`` int, cached + new tokens of each sequence (``>=`` its new tokens).
        block_tables: ``[B, max_blocks]`` int.
        scale: softmax scale.
        causal: query ``i`` of a sequence sits at position ``seq_len_k - q_len + i`` and sees keys
            up to it.
        max_seqlen_q: the longest ``q_len`` (sizes the grid); computed from ``cu_seqlens_q`` when
            omitted, which costs a device-to-host copy.
        max_seqlen_k: an upper bound of ``seq_lens_k`` known on the host. Given (with
            ``max_seqlen_q``), the call reads nothing back from the device; omitted, the lengths
            are checked against each other and the block table, a device-to-host copy.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    _require_triton()
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1 or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens_q must be an int32/int64 [B+1] tensor, got {cu_seqlens_q.dtype} "
            f"of shape {tuple(cu_seqlens_q.shape)}"
        )
    num_seqs = cu_seqlens_q.numel() - 1
    _check_common(q, k_cache, v_cache, block_tables, seq_lens_k, "seq_lens_k", num_seqs, max_seqlen_k)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if max_seqlen_k is None:
        if int(cu_seqlens_q[-1]) != q.shape[0] or bool((q_lens < 0).any()):
            raise ValueError(f"cu_seqlens_q must rise from 0 to the number of query rows ({q.shape[0]})")
        if bool((q_lens.to(seq_lens_k.device) > seq_lens_k).any()):
            raise ValueError("seq_lens_k must be >= each sequence's number of new tokens (cu_seqlens_q)")
    q = _packed_heads(q)
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if max_seqlen_q is None:
        max_seqlen_q = int(q_lens.max()) if num_seqs else 0
    if max_seqlen_q == 0:
        return out
    grid = (cdiv(max_seqlen_q, VARLEN_BLOCK_M), num_seqs, num_heads)
    _paged_varlen_kernel[grid](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens_k,
        block_tables,
        out,
        float(scale),
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=VARLEN_BLOCK_M,
        BLOCK_N=VARLEN_BLOCK_N,
        CAUSAL=causal,
        UPCAST=INTERPRETED,
    )
    return out
