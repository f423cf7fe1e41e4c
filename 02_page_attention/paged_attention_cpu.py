"""Compiled CPU kernels for paged attention, and how they are built.

The torch path (:mod:`paged_attention`) serves a decode batch in three steps: gather every
sequence's blocks into a padded ``[B, L, Hkv, D]`` copy, mask the padding, and run
``scaled_dot_product_attention``. On a CPU all three cost more than the attention itself: the
copy doubles the bytes moved, short sequences pay for the longest, and SDPA's flash kernel tiles
for many query rows while a decode brings one. ``paged_attention_cpu.cpp`` reads each sequence's
keys and values in place through its block table, float32 math throughout on whole vector
registers, in two kernels:

* **decode** (one query per sequence): one work item per (sequence, query head); keys scored a
  register's worth at a time (sixteen with AVX-512), bfloat16 widened by two bit operations per
  two registers, the next block's keys prefetched. In bfloat16 on a CPU with AVX512-BF16 a work
  item is a sequence's KV head with its whole group of query heads, so the group's keys and
  values are read from memory once; one or two long chats have their keys split into runs,
  merged with the online softmax's rescaling.
* **varlen** (prompts, chunks, verification): one work item per tile of up to two registers'
  worth of queries of one sequence that share a KV head, one query per lane, with an online
  softmax; each run of keys is widened once for the whole tile. Sequences that bring one token
  (decodes beside prompt chunks) go through the decode kernel instead, whose work item fits them.

Measured on the book's 2-core CPU, 2 threads, bfloat16, 9 query / 3 KV heads of 64 (the default
model), block size 16 (medians of 7–9 runs):

=======================================  ===================  ==========
batch                                    gather + SDPA        C++ kernel
=======================================  ===================  ==========
decode, 32 sequences of 200-380 tokens   1.6 ms               0.24 ms
decode, 128 sequences of 150-290 tokens  7.2 ms               1.14 ms
8 prompts of 256 tokens                  10.2 ms              5.8 ms
one prompt of 2,048 tokens               47.4 ms              34.7 ms
=======================================  ===================  ==========

vLLM keeps the same kind of kernels for its CPU backend (``csrc/cpu/attention.cpp``).

Compiled once per machine and cached (``cpp_kernel.py``): a later process finds the cached
shared object by a fingerprint of everything the binary depends on (the ``.cpp`` bytes, the
compile flags, torch's and Python's versions, the CPU) and loads it directly, in milliseconds.
Where it cannot be built, :func:`cpu_kernel_available` is False and chapter 02's
dispatcher keeps the torch path.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from cpp_kernel import CppKernel
from paged_attention import _check_paged_args

KERNEL = CppKernel("vllm_fs_paged_attention_cpu", Path(__file__).resolve().parent / "paged_attention_cpu.cpp")
HEAD_DIMS = (16, 32, 64, 128, 256)


@functools.cache
def load_cpu_kernel():
    """Return the extension module: loaded from the cache, compiled first if no build matches
    (:class:`cpp_kernel.CppKernel`).

    Loading it also registers the torch operator ``torch.ops.vllm_fs_cpu.store_and_attend`` (the
    engine's compiled forward calls it), with a fake implementation for tracing.

    Raises whatever the build raises (no compiler, no Python headers); see
    :func:`cpu_kernel_available` for the forgiving version.
    """
    module = KERNEL.load()
    torch.library.register_fake("vllm_fs_cpu::store_and_attend")(_store_and_attend_fake)
    return module


def _store_and_attend_fake(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


@functools.cache
def cpu_kernel_available() -> bool:
    """Whether the kernel is cached or can be built (False, with one warning, where the build fails).

    Choosing the torch path anyway is the caller's decision: ``backend="torch"`` in
    :func:`attention_backends.paged_attention`.
    """
    return KERNEL.loads(load_cpu_kernel, fallback="using the torch path")


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel takes these queries: CPU tensors of a float dtype and a compiled head size."""
    return (
        q.device.type == "cpu"
        and q.dim() == 3
        and q.shape[-1] in HEAD_DIMS
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _check_kernel_args(
    q: torch.Tensor,
    rows_name: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    lens_name: str,
) -> None:
    """What the kernels need from the Python side: q they were compiled for, then the torch
    paths' shape and dtype checks (values are checked in the C++)."""
    if not supports(q):
        raise ValueError(
            f"q must be a [{rows_name}, heads, head_dim] CPU float tensor with head_dim in {HEAD_DIMS}, "
            f"got {q.dtype} of shape {tuple(q.shape)} on {q.device}"
        )
    _check_paged_args(q, k_cache, v_cache, block_tables, lens, lens_name)


def paged_attention_decode_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`paged_attention.paged_attention_decode`, on the compiled kernel.

    Args:
        q: ``[B, Hq, D]`` CPU tensor, ``D`` in :data:`HEAD_DIMS`.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous.
        block_tables: ``[B, max_blocks]`` int, padded past each sequence's blocks.
        context_lens: ``[B]`` int, tokens each sequence attends to (the new one included), >= 1.
        scale: softmax scale.

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    _check_kernel_args(q, "batch", k_cache, v_cache, block_tables, context_lens, "context_lens")
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"context_lens must have one entry per query ({q.shape[0]}), got {context_lens.shape[0]}")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return load_cpu_kernel().paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def paged_attention_varlen_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as :func:`paged_attention.paged_attention_varlen` (causal), on the compiled kernel.

    Args:
        q: ``[T, Hq, D]`` CPU tensor, the new tokens of ``B`` sequences back to back.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous, the new tokens stored.
        cu_seqlens_q: ``[B+1]`` int, sequence ``b``'s queries are rows ``cu[b]:cu[b+1]`` of ``q``.
        seq_lens_k: ``[B]`` int, cached + new tokens of each sequence.
        block_tables: ``[B, max_blocks]`` int.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    _check_kernel_args(q, "tokens", k_cache, v_cache, block_tables, seq_lens_k, "seq_lens_k")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens_q must be a 1-D int32/int64 tensor, "
            f"got {cu_seqlens_q.dtype} of shape {tuple(cu_seqlens_q.shape)}"
        )
    return load_cpu_kernel().paged_attention_varlen(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, float(scale)
    )


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Build the CPU paged-attention kernel for this machine, or load "
        "it from the cache when the same source, flags, torch, Python and "
        "CPU were built before."
    )
    parser.parse_args()
    cached = KERNEL.is_cached()
    start = time.perf_counter()
    load_cpu_kernel()
    how = "loaded from the cache" if cached else "compiled"
    print(f"paged_attention_cpu kernel ready: {KERNEL.kernel_path()} ({how} in {time.perf_counter() - start:.3f} s)")


if __name__ == "__main__":
    main()
