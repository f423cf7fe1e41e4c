"""Exercises 02.1, 02.2, 02.3 of 02_page_attention: your versions of paged_attention.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 02_page_attention/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from block_manager import cdiv
from paged_attention import _check_capacity, _check_gqa, _check_paged_args


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Read ``[B, max_len, Hkv, D]`` from a paged cache: blocks come back in logical order.

    Entries of ``block_tables`` past a sequence's blocks may hold anything (padding); they are
    clamped to a valid index here and hidden by the caller's length mask.

    Hint: Index the cache with the first cdiv(max_len, block_size) entries of each block table
    (clamped: padding may hold anything), flatten blocks and slots into one axis, cut at
    max_len.

    Checked by: pytest 02_page_attention/ --impl=student --exercise 02.1
    """
    raise NotImplementedError("Exercise 02.1: implement gather_kv — see 02_page_attention/README.md#exercises")


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

    Hint: Validate first, raising ValueError (_check_paged_args, one context length per query
    and each >= 1, _check_capacity): a one-row block table would otherwise broadcast over the
    batch. Then gather_kv for K and V, mask positions at or past each context length, and let
    scaled_dot_product_attention do the softmax (enable_gqa=True, or fold each kv head's G query
    heads into the query axis: q.view(B, Hkv, G, D)); or write the softmax yourself.

    Checked by: pytest 02_page_attention/ --impl=student --exercise 02.2
    """
    raise NotImplementedError(
        "Exercise 02.2: implement paged_attention_decode — see 02_page_attention/README.md#exercises"
    )


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

    Hint: Validate first (_check_paged_args, _check_capacity). Sequence b's queries are rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and sit at the last positions of its seq_lens_k[b] keys:
    query i sees the keys at positions up to kv_len - q_len + i (causal), or all of them
    (causal=False). Single-token rows can go through paged_attention_decode in one batch.
    Offsets that do not rise from 0 to the number of query rows are a ValueError naming
    cu_seqlens_q; a sequence with more new tokens than keys, or with no keys at all, one naming
    seq_lens_k.

    Checked by: pytest 02_page_attention/ --impl=student --exercise 02.3
    """
    raise NotImplementedError(
        "Exercise 02.3: implement paged_attention_varlen — see 02_page_attention/README.md#exercises"
    )
