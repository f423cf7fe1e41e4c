"""The engine's bfloat16 matmul on CPUs with AVX-512 BF16 (``bf16_gemm.cpp``): every linear layer
and the LM head, eager and in the compiled graphs.

A decode step is matrix-vector products over every weight: at one row the time is reading the
weights, at 32 it starts to be arithmetic. oneDNN's bfloat16 GEMM (what ``F.linear`` and the
packed weights of ``prepacked.py`` call) reads a weight at about half the memory's speed for a
row or two, and inductor's own C++ GEMM, which does read at memory speed for one row, falls far
behind from four. The C++ kernel here packs each weight once into the layout its instruction
reads (``vdpbf16ps``: 16 pairs of bfloat16 products summed into float32 lanes) and keeps as many
independent sums as the rows allow. Measured against both on every weight shape of the default
model, in ``07_engine/benchmarks/bench_linears.py`` (07_engine/topics/performance.md).

It is a torch operator, ``torch.ops.vllm_fs_gemm.linear``, with a fake implementation, so the
compiled graphs trace through it and call it between their fused loops, the packed weights frozen
as its constants, in place of inductor's own GEMM template (``compilation.template_graphs``).
Products are float32 sums of the exact bfloat16 products, rounded once to bfloat16 as oneDNN's
are, in another order.

Built once per machine and cached as chapter 02's kernels are (``cpp_kernel.py``), only where
``/proc/cpuinfo`` lists ``avx512_bf16``: elsewhere :func:`gemm_available` is False and the layers
keep oneDNN and inductor.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from types import ModuleType

import torch

from cpp_kernel import CppKernel, cpu_flags

KERNEL = CppKernel("vllm_fs_bf16_gemm", Path(__file__).resolve().with_suffix(".cpp"))


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has AVX-512 BF16's dot-product instruction, which the kernel is made of."""
    return platform.machine() in ("x86_64", "AMD64") and "avx512_bf16" in cpu_flags()


@functools.cache
def _load() -> ModuleType:
    module = KERNEL.load()
    torch.library.register_fake("vllm_fs_gemm::linear")(_linear_fake)
    return module


def _linear_fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features), dtype=dtype or x.dtype)


@functools.cache
def gemm_available() -> bool:
    """Whether the kernel runs here: the CPU has AVX-512 BF16 and the build succeeds (False, with
    one warning, where it fails)."""
    if not cpu_has_bf16_dot():
        return False
    return KERNEL.loads(_load, fallback="the linear layers keep oneDNN")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]`` bfloat16 on the CPU) in the kernel's layout: ``[ceil(out/16),
    ceil(in/2), 16, 2]``, zeros past ``out`` and ``in``. Needs :func:`gemm_available`."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"weight must be a 2-D bfloat16 CPU tensor, got {weight.dtype} {tuple(weight.shape)}")
    return _load().pack(weight.detach())


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bfloat16 ``x`` (``[..., in]``) and ``packed = pack(weight)``,
    ``out_features`` being ``weight``'s row count. ``dtype=torch.float32`` returns the float32 sums
    unrounded; the default rounds them to bfloat16."""
    if dtype not in (None, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return torch.ops.vllm_fs_gemm.linear(x, packed, bias, out_features, dtype)
