"""RMSNorm, with the residual add fused in (as vLLM and nano-vllm do)."""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 like Hugging Face's ``LlamaRMSNorm``.

    ``forward(x, residual)`` first adds ``residual`` to ``x`` and returns ``(normed, x + residual)``,
    which is the next layer's residual: one call instead of an add and a norm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm normalises a bf16 x in float32 and rounds once, as Hugging Face does;
        # the weight then multiplies in x's dtype, also as there. Two ops instead of eight: a
        # decode step runs 61 norms, each of them mostly per-op overhead.
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.weight

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
