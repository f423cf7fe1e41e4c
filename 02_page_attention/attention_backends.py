"""One entry point for paged attention, four implementations behind it.

:func:`paged_attention` takes the batch as the engine describes it, one
:class:`AttentionMetadata` record (packed queries' offsets ``cu_seqlens_q``, ``seq_lens_k``,
``block_tables``, ...), and sends it to the best implementation available for the tensors it is
given:

=========  =============================================  ==========================================
backend    when ``"auto"`` picks it                        module
=========  =============================================  ==========================================
flash      CUDA tensors, flash-attn installed, float16 /   :mod:`flash_attention` (flash-attn 2)
           bfloat16, ``block_size`` a multiple of 256
triton     CUDA tensors otherwise                          :mod:`paged_attention_triton`
cpp        CPU tensors, the C++ kernels build, a head      :mod:`paged_attention_cpu`
           size they were compiled for
torch      CPU tensors otherwise                           :mod:`paged_attention`
=========  =============================================  ==========================================

A batch where every sequence brings exactly one token (``max_seqlen_q == 1``) takes each
backend's decode kernel; anything else takes its varlen kernel. The dispatcher hands each kernel
the fields of the record it reads: the kernels keep their own explicit arguments, which is how
this chapter teaches them. Naming a backend forces it (``"triton"`` on a CPU runs Triton's
interpreter: exact and slow, for tests and the demo). The choice belongs to the caller — an engine
passes its configured backend down — so no environment variable overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_attention import FLASH_BLOCK_MULTIPLE, HAS_FLASH_ATTN, flash_decode, flash_varlen
from paged_attention import paged_attention_decode, paged_attention_varlen
from paged_attention_cpu import (
    cpu_kernel_available,
    paged_attention_decode_cpu,
    paged_attention_varlen_cpu,
    supports,
)
from paged_attention_triton import HAS_TRITON, INTERPRETED, paged_attention_decode_triton, paged_attention_varlen_triton

BACKENDS = ("auto", "flash", "triton", "cpp", "torch")


@dataclass
class AttentionMetadata:
    """What attention needs to know about one batch of ``B`` sequences and ``T`` new tokens
    (vLLM's name): chapter 06's batch builder makes it, every backend and the engine's attention
    layer take it.

    Attributes:
        slot_mapping: ``[T]`` cache slot of each new token (-1: do not store), where the layer
            writes the new K/V before attending (chapter 01's ``store_kvcache``).
        cu_seqlens_q: ``[B+1]`` int32 offsets of each sequence's new tokens in the batch.
        seq_lens_k: ``[B]`` int32 tokens each sequence attends to (cached + new).
        block_tables: ``[B, max_blocks]`` int32 physical blocks of each sequence (padded).
        max_seqlen_q: the most new tokens any sequence has (1: a pure decode batch).
        max_seqlen_k: an upper bound of ``seq_lens_k`` known on the host; given, the flash and
            Triton paths read nothing back from the device (no sync per layer); None: read from
            the tensor where needed.
        kv_cache: the whole ``[2, layers, blocks, block_size, kv_heads, head_dim]`` cache when a
            compiled forward takes it as an input (the engine's ``compilation.py``); None
            otherwise. The backends never read it.
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int | None = None
    kv_cache: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one token: the decode kernels apply."""
        return self.max_seqlen_q == 1

    def tensors(self) -> list[torch.Tensor]:
        """The batch's tensors, in field order: what an operator that cannot take this record
        takes instead (:meth:`from_tensors` makes it again)."""
        return [self.slot_mapping, self.cu_seqlens_q, self.seq_lens_k, self.block_tables]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], max_seqlen_q: int) -> AttentionMetadata:
        slot_mapping, cu_seqlens_q, seq_lens_k, block_tables = tensors
        return cls(slot_mapping, cu_seqlens_q, seq_lens_k, block_tables, max_seqlen_q)


def select_backend(q: torch.Tensor, k_cache: torch.Tensor, backend: str = "auto") -> str:
    """The implementation :func:`paged_attention` will run: ``backend`` itself unless it is "auto"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not (HAS_TRITON and (q.is_cuda or INTERPRETED)):
        raise ValueError(
            "backend 'triton' needs triton and CUDA tensors (on a CPU, TRITON_INTERPRET=1 "
            "set before the kernels were imported)"
        )
    if backend == "cpp" and not (supports(q) and cpu_kernel_available()):
        raise ValueError("backend 'cpp' needs CPU float tensors of a compiled head size and a C++ compiler")
    if backend != "auto":
        return backend
    if q.is_cuda:
        flash_ok = (
            HAS_FLASH_ATTN
            and q.dtype in (torch.float16, torch.bfloat16)
            and k_cache.shape[1] % FLASH_BLOCK_MULTIPLE == 0
        )
        if flash_ok:
            return "flash"
        if HAS_TRITON:
            return "triton"
        return "torch"
    return "cpp" if supports(q) and cpu_kernel_available() else "torch"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of packed new tokens over their paged context, by the chosen backend.

    Args:
        q: ``[T, Hq, D]``, the new tokens of ``B`` sequences back to back.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, the new tokens already stored.
        attn_metadata: the batch (:class:`AttentionMetadata`).
        scale: softmax scale.
        backend: "auto" (see the module docstring), "flash", "triton", "cpp" or "torch".

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    md = attn_metadata
    name = select_backend(q, k_cache, backend)
    if md.is_decode and q.shape[0] == md.block_tables.shape[0]:
        if name == "flash":
            return flash_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens_k, scale)
        if name == "triton":
            return paged_attention_decode_triton(
                q, k_cache, v_cache, md.block_tables, md.seq_lens_k, scale, md.max_seqlen_k
            )
        if name == "cpp":
            return paged_attention_decode_cpu(q, k_cache, v_cache, md.block_tables, md.seq_lens_k, scale)
        return paged_attention_decode(
            q, k_cache, v_cache, md.block_tables, md.seq_lens_k, scale, max_len=md.max_seqlen_k
        )
    if name == "flash":
        max_seqlen_k = int(md.seq_lens_k.max()) if md.max_seqlen_k is None else md.max_seqlen_k
        return flash_varlen(
            q, k_cache, v_cache, md.cu_seqlens_q, md.seq_lens_k, md.block_tables, scale, md.max_seqlen_q, max_seqlen_k
        )
    if name == "triton":
        return paged_attention_varlen_triton(
            q,
            k_cache,
            v_cache,
            md.cu_seqlens_q,
            md.seq_lens_k,
            md.block_tables,
            scale,
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_k=md.max_seqlen_k,
        )
    if name == "cpp":
        return paged_attention_varlen_cpu(q, k_cache, v_cache, md.cu_seqlens_q, md.seq_lens_k, md.block_tables, scale)
    return paged_attention_varlen(q, k_cache, v_cache, md.cu_seqlens_q, md.seq_lens_k, md.block_tables, scale)
