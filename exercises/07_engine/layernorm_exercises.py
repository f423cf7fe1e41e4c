"""Exercise 07.9 of 07_engine: your versions of vllm_from_scratch/layers/layernorm.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch


def forward(
    self, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Extra: RMSNorm, with the residual add fused in

    Becomes ``RMSNorm.forward`` (a method: ``self`` is the RMSNorm). Call parent methods as
    ``Parent.method(self, ...)``, not ``super()``.

    Hint: Normalize in float32, x * rsqrt(mean(x^2) + eps), round that to x's dtype, then
    multiply by weight in x's dtype (transformers' LlamaRMSNorm, bit for bit in bfloat16); with
    a residual, add it to x first and return (normed, x + residual), the new residual.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.9
    """
    raise NotImplementedError("Exercise 07.9: implement RMSNorm.forward — see 07_engine/README.md#exercises")
