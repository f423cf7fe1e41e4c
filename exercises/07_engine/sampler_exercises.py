"""Exercises 07.1, 07.7, 07.8 of 07_engine: your versions of vllm_from_scratch/sampler.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from vllm_from_scratch.sampler import uniform_noise


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and top-p set.

    ``top_ks`` holds ``vocab_size`` for "off"; ``top_ps`` holds 1.0 for "off". The most likely
    token always survives, so no row is left empty.

    Hint: Sort each row once; mask ranks >= top_k; over the softmax of what is left, drop a
    token when the tokens before it already reach top_p; never mask the most likely token;
    scatter back.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.1
    """
    raise NotImplementedError("Exercise 07.1: implement apply_top_k_top_p — see 07_engine/README.md#exercises")


def compute_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution each row samples from (one-hot on the argmax for greedy rows).

    Speculative decoding's rejection sampler needs these probabilities, not just a sample.

    Becomes ``Sampler.compute_probs`` (a method: ``self`` is the Sampler). Call parent methods
    as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Temperatures below 1e-5 are greedy: divide the other rows' logits by their
    temperature, apply_top_k_top_p, softmax, then put a one-hot argmax row in place of every
    greedy row.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.7
    """
    raise NotImplementedError("Exercise 07.7: implement Sampler.compute_probs — see 07_engine/README.md#exercises")


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """One exact draw per row by inverse transform: the first token whose cumulative
    probability reaches ``u`` times the row's total, ``u`` uniform in ``(0, 1]``.

    The point ``u * total`` is above 0 and at most the total, so the token found adds
    probability of its own: a zero-probability token (masked by top-k or top-p) never is.

    Becomes ``Sampler.sample_from_probs`` (a method: ``self`` is the Sampler). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: The first token whose cumulative probability reaches u times the row's total, with one
    uniform u in (0, 1] per row, is an exact draw (torch.searchsorted on the cumsum); draw a
    seeded row's u from its own generator (uniform_noise) so the rest of the batch cannot change
    it.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.8
    """
    raise NotImplementedError("Exercise 07.8: implement Sampler.sample_from_probs — see 07_engine/README.md#exercises")
