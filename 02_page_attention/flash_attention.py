"""flash-attn's paged-KV calls, behind the same arguments as the torch and Triton paths.

`flash-attn <https://github.com/Dao-AILab/flash-attention>`_ 2 reads a paged cache itself:
both of its entry points take a ``block_table`` and then treat ``k_cache``/``v_cache``
(``[num_blocks, block_size, kv_heads, head_dim]``, chapter 01's layout) as the pool of pages.
nano-vllm calls exactly these two functions, and so do we:

* prefill (and anything with several new tokens per sequence):
  ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, softmax_scale, causal=True, block_table=...)``. flash-attn wants *cumulative*
  key lengths, so :func:`flash_varlen` turns our ``seq_lens_k`` into ``cu_seqlens_k``. Its causal
  mask is aligned to the bottom-right corner when there are more keys than queries, which is our
  "cached context first" convention.
* decode: ``flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=...,
  block_table=...)``: one query per sequence, as a batch of length-1 sequences.

flash-attn's constraints, checked here so that a wrong call fails with a readable
``ValueError`` instead of a CUDA error: CUDA tensors, float16 or bfloat16, and a paged block size
that is a multiple of 256 (the reason nano-vllm's default ``kvcache_block_size`` is 256, and
chapter 07's config picks 256 when :data:`HAS_FLASH_ATTN`). The package needs a GPU and a CUDA
toolkit to build, so on a CPU machine ``HAS_FLASH_ATTN`` is False and these functions raise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    HAS_FLASH_ATTN = True
except ImportError:  # not installed, or built for another torch/CUDA: fall back to Triton or torch
    HAS_FLASH_ATTN = False

FLASH_BLOCK_MULTIPLE = 256


def _check_flash_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not HAS_FLASH_ATTN:
        raise RuntimeError(
            "flash-attn is not installed (pip install flash-attn on a CUDA machine); "
            "use paged_attention or paged_attention_triton"
        )
    if not (q.is_cuda and k_cache.is_cuda and v_cache.is_cuda):
        raise ValueError("q, k_cache and v_cache must be CUDA tensors for flash-attn")
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"q, k_cache and v_cache must all be float16 or all bfloat16 for flash-attn, "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.dim() != 4 or k_cache.shape[1] % FLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, kv_heads, head_dim] with block_size a "
            f"multiple of {FLASH_BLOCK_MULTIPLE} for flash-attn's paged KV, got shape {tuple(k_cache.shape)}"
        )


def flash_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache with ``flash_attn_varlen_func``.

    Same meaning as :func:`paged_attention.paged_attention_varlen` (``q``: ``[T, Hq, D]``,
    ``cu_seqlens_q``: ``[B+1]``, ``seq_lens_k``: ``[B]`` cached + new tokens, ``block_tables``:
    ``[B, max_blocks]``), plus the two maxima flash-attn sizes its grid with.
    """
    _check_flash_args(q, k_cache, v_cache)
    cu_seqlens_k = F.pad(seq_lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q.int(),
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=block_tables.int(),
    )


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence with ``flash_attn_with_kvcache``; the arguments of
    :func:`paged_attention.paged_attention_decode` (``q``: ``[B, Hq, D]``), result ``[B, Hq, D]``."""
    _check_flash_args(q, k_cache, v_cache)
    out = flash_attn_with_kvcache(
        q.unsqueeze(1),
        k_cache,
        v_cache,
        cache_seqlens=context_lens.int(),
        block_table=block_tables.int(),
        softmax_scale=scale,
        causal=True,
    )
    return out.squeeze(1)
