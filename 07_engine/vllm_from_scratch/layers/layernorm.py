"""RMSNorm, with the residual add fused in (as vLLM and nano-vllm do)."""

from __future__ import annotations

import torch
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
        # ||x|| in one float32 pass over bf16 x (vector_norm upcasts as it reads): 3x faster on a
        # 2048-token prefill than x.float().pow(2).mean(), which writes two float32 copies first.
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        inv_rms = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(self.eps))
        return self.weight * (x * inv_rms).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
