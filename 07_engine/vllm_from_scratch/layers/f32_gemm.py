"""The engine's float32 matmul on CPUs with AVX2 and FMA (``f32_gemm.cpp``): every linear layer
of a float32 model, eager and in the compiled graphs.

A float32 model runs where the CPU has no bfloat16 arithmetic (an AVX2 laptop, a Zen 3 server).
There oneDNN's packed float32 GEMM reads a weight at about half the memory's speed for a few
rows, and inductor's own template (``compilation.py``) falls behind from about eight. The kernel
here packs each weight once into the layout its FMAs read and keeps 12 independent sums in
registers; for many rows it splits x into bands that stay in the L2 cache. All the default
model's weights on a 2-core Zen 3: 1 row 24 ms against oneDNN's 46, 16 rows 51 against 73, 128
rows 250 against 278, 512 rows 930 against 946 (07_engine/topics/other_cpus.md).

It is a torch operator, ``torch.ops.vllm_fs_f32_gemm.linear``, with a fake implementation, so the
compiled graphs trace through it. Products are float32 sums in another order than oneDNN's.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from types import ModuleType

import torch

from cpp_kernel import CppKernel, cpu_flags

KERNEL = CppKernel("vllm_fs_f32_gemm", Path(__file__).resolve().with_suffix(".cpp"))


def cpu_has_avx2_fma() -> bool:
    """Whether this CPU has the AVX2 and FMA instructions the kernel is made of."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= cpu_flags()


@functools.cache
def _load() -> ModuleType:
    module = KERNEL.load()
    torch.library.register_fake("vllm_fs_f32_gemm::linear")(_linear_fake)
    return module


def _linear_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@functools.cache
def gemm_available() -> bool:
    """Whether the kernel runs here: the CPU has AVX2 and FMA and the build succeeds (False, with
    one warning, where it fails)."""
    if not cpu_has_avx2_fma():
        return False
    return KERNEL.loads(_load, fallback="the linear layers keep oneDNN")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]`` float32 on the CPU) in the kernel's layout: ``[ceil(out/8), in,
    8]``, zeros past ``out``. Needs :func:`gemm_available`."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"weight must be a 2-D float32 CPU tensor, got {weight.dtype} {tuple(weight.shape)}")
    return _load().pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 ``x`` (``[..., in]``) and ``packed = pack(weight)``,
    ``out_features`` being ``weight``'s row count."""
    return torch.ops.vllm_fs_f32_gemm.linear(x, packed, bias, out_features)
