"""Exercises 05.1, 05.7 of 05_spec_decode: your versions of spec_decode.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 05_spec_decode/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from spec_decode import PLACEHOLDER_TOKEN_ID, RejectionNoise, sample_rejection_noise, validate_rejection_inputs


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    noise: RejectionNoise | None = None,
) -> torch.Tensor:
    """Verify K drafts per request so that the emitted tokens follow ``target_probs`` exactly.

    Args:
        draft_token_ids: ``[B, K]`` long; a request with fewer drafts pads with -1 at the end.
        draft_probs: ``[B, K, V]``, the distribution each draft was sampled from; ``None`` for
            deterministic drafts (one-hot, e.g. n-gram or greedy drafts).
        target_probs: ``[B, K+1, V]``, the target's distribution at each draft position plus the
            one after the last draft.
        generator: torch generator for reproducible sampling.
        noise: precomputed random numbers (overrides ``generator``); see
            :func:`sample_rejection_noise`.

    Returns:
        ``[B, K+1]`` long: the accepted drafts, then the recovered (after a rejection) or bonus
        (all accepted) token, then -1.

    Hint: validate_rejection_inputs does the checking (and gives one-hot q for None), and
    sample_rejection_noise the randomness unless noise= is given (so the Triton kernel can share
    it). Accept draft j while u_j * q(x_j) < p(x_j), -1 padding never (a cumulative product
    finds the first rejection). The next token comes from max(p - q, 0) at the first rejection
    (p itself if that has no mass left), or from p[K_i] after all K_i drafts (the bonus), each
    drawn as the exponential race argmax(weights / noise.exponential[b]); -1 after it.

    Checked by: pytest 05_spec_decode/ --impl=student --exercise 05.1
    """
    raise NotImplementedError("Exercise 05.1: implement rejection_sample — see 05_spec_decode/README.md#exercises")


def rejection_sampling_batched(
    target_sampled: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_speculative_steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification over vLLM's flattened layout, vectorised: no loop over requests.

    Request r owns flat positions ``cu_num_logits[r] : cu_num_logits[r+1]`` (its drafts plus
    one). ``target_sampled[i]`` is the target's token at position i; ``draft_tokens`` is the
    input ids, so the draft checked against ``target_sampled[i]`` is ``draft_tokens[i + 1]``.
    This is exact-match verification: it keeps the target distribution only when the target
    tokens are greedy (or the drafts are one-hot, see :func:`rejection_sample`).

    Returns ``(sampled [num_reqs, num_speculative_steps + 1] with -1 padding, num_sampled)``.

    Hint: Request r owns flat positions cu_num_logits[r]:cu_num_logits[r+1]; the draft that
    position i verifies is draft_tokens[i + 1]; keep target tokens up to and including the first
    mismatch. Vectorise with a [num_reqs, k + 1] index grid. Offsets that give a request no
    position or more than k + 1, or do not end at len(target_sampled), are a ValueError.

    Checked by: pytest 05_spec_decode/ --impl=student --exercise 05.7
    """
    raise NotImplementedError(
        "Exercise 05.7: implement rejection_sampling_batched — see 05_spec_decode/README.md#exercises"
    )
