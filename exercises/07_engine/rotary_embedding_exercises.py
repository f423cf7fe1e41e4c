"""Exercises 07.4, 07.10 of 07_engine: your versions of vllm_from_scratch/layers/rotary_embedding.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.x's frequency-dependent stretch: long wavelengths slowed by ``factor``.

    Hint: wavelength = 2 * pi / inv_freq. Frequencies whose wavelength is longer than
    original_max_position_embeddings / low_freq_factor are divided by factor; shorter than
    original_max_position_embeddings / high_freq_factor, kept; in between (ends included), with
    smooth = (original_max_position_embeddings / wavelength - low_freq_factor) /
    (high_freq_factor - low_freq_factor), they become (1 - smooth) * inv_freq / factor + smooth
    * inv_freq. low_freq_factor and high_freq_factor default to 1 and 4.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.4
    """
    raise NotImplementedError("Exercise 07.4: implement _llama3_inv_freq — see 07_engine/README.md#exercises")


def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Extra: rotary position embeddings from a precomputed cos/sin cache

    Becomes ``RotaryEmbedding.forward`` (a method: ``self`` is the RotaryEmbedding). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Look up self.cos_sin_cache[positions] and cast it to q's dtype (the rotation runs in
    q's dtype, as in transformers), split it into cos and sin, and rotate the two halves of
    every head of q and k (self._rotate does one tensor).

    Checked by: pytest 07_engine/ --impl=student --exercise 07.10
    """
    raise NotImplementedError("Exercise 07.10: implement RotaryEmbedding.forward — see 07_engine/README.md#exercises")
