"""Weights packed once for the CPU's matmul library: the same products, less work per step.

Before a CPU GEMM multiplies, the library reorders ("packs") the weight matrix into the tiled layout
its inner kernels stream through. ``F.linear`` repacks on every call, and at decode sizes that
copy is a large share of the call: an engine multiplies by the same weights every step, so it
packs them once after loading. Measured on the book's 2-core CPU (AVX-512 BF16, no AMX):

=============================  ==========  =========  ==========  =========
``[M x 576] @ [576 x 3072]``   bf16        bf16       float32     float32
(µs)                           F.linear    packed     F.linear    packed
=============================  ==========  =========  ==========  =========
M = 1 (one decode)             117         56         137         66
M = 32 (a decode batch)        340         280        849         531
M = 2048 (a prefill)           17,200      16,600     39,500      34,100
=============================  ==========  =========  ==========  =========

and a whole batch-32 bf16 decode step of the default model drops from about 86 to 75 ms. In
bfloat16 the results are bit-identical to ``F.linear``; in float32 (where ``F.linear`` calls
MKL, not oneDNN) they differ in summation order, by float32 rounding
(``test_engine_layers.py`` checks both).

The ops are the ones ``torch.compile``'s CPU weight-freezing pass emits
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``). They are private, so
:func:`pack_weight` returns ``None`` wherever they are missing or do not apply (a GPU, float16,
a CPU without bf16 support in oneDNN) and the layers keep calling ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` applies: a 2-D float32 or bfloat16 CPU weight, and a oneDNN
    build that has the ops (and, for bfloat16, the CPU support)."""
    mkldnn = torch.ops.mkldnn
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise")):
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed copy of ``weight`` when there is one."""
    if packed is None or x.dtype != packed.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PrepackableWeight:
    """Mixin for a module with a 2-D ``weight``: ``prepack()`` it once loaded, then ``self.matmul(x)``."""

    packed_weight: torch.Tensor | None = None

    def prepack(self) -> bool:
        """Pack the loaded weight (a copy: a tied embedding keeps its own rows); False if it does not apply."""
        self.packed_weight = pack_weight(self.weight)
        return self.packed_weight is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, bias, self.packed_weight)


def prepack_model(model: torch.nn.Module) -> int:
    """Pack the weight of every module that has a ``prepack()`` method; returns how many packed.

    Call it after the weights are loaded: a packed copy does not follow later edits of
    ``weight``.
    """
    return sum(bool(m.prepack()) for m in model.modules() if hasattr(m, "prepack"))
