"""Weights packed once for the CPU's matmul: the same products, less work per step.

Where the CPU has AVX-512 BF16, a bfloat16 weight is packed for the engine's own GEMM
(``bf16_gemm.py``), and where it has AVX2 and FMA, a float32 weight for the engine's float32 GEMM
(``f32_gemm.py``): each is as fast as oneDNN or faster at every row count measured, and every
matmul of that weight takes it. What follows is the path of every other matmul.

``F.linear`` has oneDNN reorder ("pack") the weight into its tiled layout on every call, a large
share of a decode-sized matmul, so the engine packs once after loading (07_engine/README.md,
"Layers"). bfloat16 results are bit-identical; float32 ones (``F.linear`` calls MKL there) differ
in summation order. The ops are the private ones ``torch.compile``'s CPU weight freezing emits,
so :func:`pack_weight` returns ``None`` wherever they are missing or do not apply and the layers
keep calling ``F.linear``.

Some CPUs run oneDNN's bf16 GEMM slower than its float32 one (a 2-core Xeon VM with AMX hidden:
83 against 150 GFLOP/s per core). There a bf16 weight also keeps a packed float32 copy, which
matmuls of :data:`FLOAT32_MIN_ROWS` rows or more use: exact upcasts and float32 accumulation
either way, so the same products summed in another order. :func:`bf16_matmul_is_slow` decides.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from vllm_from_scratch.layers import bf16_gemm, f32_gemm

# Rows from which a matmul is compute-bound enough for the float32 copy to win. Measured on the
# VM above, all linear shapes of SmolLM2-135M plus its LM head, float32 time / bf16 time:
# 16 rows 1.03-1.06, 32 rows 0.85, 128 rows 0.65, 512 rows 0.73 (1 and 2 threads alike).
FLOAT32_MIN_ROWS = 32


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` applies: a 2-D float32 or bfloat16 CPU weight, and a oneDNN
    build that has the ops (and, for bfloat16, the CPU support)."""
    mkldnn = torch.ops.mkldnn
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    ):
        return False
    return weight.dtype == torch.float32 or bool(mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor, batch_size_hint: int = 32) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) in oneDNN's packed layout, or ``None`` where packing does not apply.

    ``batch_size_hint`` lets oneDNN pick a layout for a typical number of rows; any number of
    rows works with the packed weight.
    """
    if not can_pack(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
    except RuntimeError:  # a oneDNN build that lists the op but cannot reorder for this CPU
        return None


def _cpu_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


@functools.cache
def bf16_matmul_is_slow() -> bool:
    """Whether this CPU's packed bf16 GEMM is clearly (25 %) slower than its float32 GEMM.

    Timed once per process on a ``[256 x 576] @ [576 x 1536]`` product (about 20 ms), on one
    thread and in CPU time, so that other jobs sharing the machine cannot tip the choice.
    """
    if not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)):
        return False
    x, w = torch.randn(256, 576), torch.randn(1536, 576)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.bfloat16, torch.float32):
            xd, packed = x.to(dtype), pack_weight(w.to(dtype), 256)
            seconds[dtype] = _cpu_seconds(
                functools.partial(torch.ops.mkldnn._linear_pointwise, xd, packed, None, "none", [], "")
            )
    finally:
        torch.set_num_threads(threads)
    return 1.25 * seconds[torch.float32] < seconds[torch.bfloat16]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    packed_fp32: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed copy of ``weight`` when there is one, and
    from :data:`FLOAT32_MIN_ROWS` rows through its packed float32 copy when there is one.

    A graph being compiled gets plain ``F.linear``: inductor packs frozen weights itself, and
    oneDNN's packed tensors are opaque to its tracer (``compilation.py``)."""
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    if packed_fp32 is not None and x.numel() >= FLOAT32_MIN_ROWS * x.shape[-1] and x.device.type == "cpu":
        bias = None if bias is None else bias.float()
        return torch.ops.mkldnn._linear_pointwise(x.float(), packed_fp32, bias, "none", [], "").to(x.dtype)
    if packed is None or x.dtype != packed.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PrepackableWeight:
    """Mixin for a module with a 2-D ``weight``: ``prepack()`` it once loaded, then ``self.matmul(x)``."""

    weight: torch.nn.Parameter
    gemm_weight: torch.Tensor | None = None
    packed_weight: torch.Tensor | None = None
    packed_weight_fp32: torch.Tensor | None = None

    def prepack(self, float32_copy: bool | None = None) -> bool:
        """Pack the loaded weight (a copy: a tied embedding keeps its own rows); False if packing
        does not apply.

        A bfloat16 CPU weight is packed for the engine's own GEMM where it runs
        (:func:`bf16_gemm.gemm_available`), a float32 one for the engine's float32 GEMM where it
        runs (:func:`f32_gemm.gemm_available`); every matmul then takes it, compiled ones too.
        Otherwise the weight is packed for oneDNN, with a float32 copy of a bf16 weight when
        ``float32_copy`` (``None``: where :func:`bf16_matmul_is_slow`)."""
        self.gemm_weight = self.packed_weight = self.packed_weight_fp32 = None
        on_cpu = self.weight.device.type == "cpu"
        if self.weight.dtype == torch.bfloat16 and on_cpu and bf16_gemm.gemm_available():
            self.gemm_weight = bf16_gemm.pack(self.weight)
            return True
        if self.weight.dtype == torch.float32 and on_cpu and f32_gemm.gemm_available():
            self.gemm_weight = f32_gemm.pack(self.weight)
            return True
        self.packed_weight = pack_weight(self.weight)
        if self.packed_weight is not None and self.weight.dtype == torch.bfloat16:
            if bf16_matmul_is_slow() if float32_copy is None else float32_copy:
                self.packed_weight_fp32 = pack_weight(self.weight.float())
        return self.packed_weight is not None

    def _gemm_weight_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The weight packed for the engine's GEMM where its product with ``x`` goes through it: ``x``
        on the CPU in the packed weight's dtype."""
        packed = self.gemm_weight
        if packed is None or x.dtype != packed.dtype or x.device.type != "cpu":
            return None
        return packed

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (packed := self._gemm_weight_for(x)) is not None:
            if x.dtype == torch.float32:
                return f32_gemm.linear(x, packed, bias, self.weight.shape[0])
            return bf16_gemm.linear(x, packed, bias, self.weight.shape[0])
        return linear(x, self.weight, bias, self.packed_weight, self.packed_weight_fp32)

    def matmul_unrounded(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T`` as float32 sums of the 16-bit products, never rounded to 16 bits, where
        the engine's bfloat16 GEMM runs for ``x``; None elsewhere (oneDNN and CUDA round to
        ``x``'s dtype, and a float32 product has nothing to round)."""
        if x.dtype == torch.bfloat16 and (packed := self._gemm_weight_for(x)) is not None:
            return bf16_gemm.linear(x, packed, None, self.weight.shape[0], torch.float32)
        return None


@runtime_checkable
class Prepackable(Protocol):
    """What :func:`prepack_model` looks for: any module with a ``prepack()`` method, whether or not
    it uses the mixin (a registered model's own layers may pack their own way)."""

    def prepack(self, float32_copy: bool | None = None) -> bool: ...


def prepack_model(model: torch.nn.Module, float32_copies: bool | None = None) -> int:
    """Pack the weight of every module that has a ``prepack()`` method; returns how many packed.

    ``float32_copies`` also keeps float32 copies of bf16 weights for large matmuls: ``None``
    where :func:`bf16_matmul_is_slow`, or always / never. Call it after the weights are loaded:
    a packed copy does not follow later edits of ``weight``.
    """
    return sum(bool(m.prepack(float32_copies)) for m in model.modules() if isinstance(m, Prepackable))
