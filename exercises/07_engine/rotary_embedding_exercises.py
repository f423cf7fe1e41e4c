"""Exercise 07.5 of 07_engine: your versions of vllm_from_scratch/layers/rotary_embedding.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch


def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Rotary position embeddings from a precomputed cos/sin cache

    Becomes ``RotaryEmbedding.forward`` (a method: ``self`` is the RotaryEmbedding). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Look up self.cos_sin_cache[positions], split it into cos and sin, and rotate the two
    halves of every head of q and k (self._rotate does one tensor).

    Checked by: pytest 07_engine/ --impl=student --exercise 07.5
    """
    raise NotImplementedError("Exercise 07.5: implement RotaryEmbedding.forward — see 07_engine/README.md#exercises")
