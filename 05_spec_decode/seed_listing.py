"""Seed 000's speculative-decoding listing, run against this chapter's functions.

The listing (docs/sources.md, seed 000, its chapter 9) drives a toy ``SimpleLM`` through
``draft_generate``, ``verify_and_sample`` and ``speculative_decode_step``. The chapter keeps those
names; a caller written for the listing meets three differences:

* ``get_logits`` takes ``num_logits``, how many last positions to score (verification scores
  K + 1 in one call); the listing's model always returned every position. :class:`SimpleLM`
  here answers both calls.
* ``verify_and_sample``'s fourth argument is the draft's probabilities ``q``, which rejection
  sampling needs (the listing computed draft logits and never used them), so ``temperature`` goes
  by keyword there. ``draft_generate`` and ``speculative_decode_step`` take the listing's
  positional arguments unchanged.
* the step's statistics count ``num_emitted`` tokens where the listing wrote ``speedup``.

``python 05_spec_decode/seed_listing.py`` runs the listing's flow with a draft that mostly
agrees with its target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spec_decode import draft_generate, speculative_decode_step, speculative_generate, verify_and_sample


class SimpleLM:
    """The listing's toy model: the hidden state at a position is the sum of the embeddings so far.

    Weights are drawn from ``seed`` with a private generator, so building a model leaves torch's
    global random state alone.
    """

    def __init__(self, vocab_size: int, hidden_size: int = 64, seed: int = 42):
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.embedding = torch.randn(vocab_size, hidden_size, generator=generator) * 0.1
        self.lm_head = torch.randn(hidden_size, vocab_size, generator=generator) * 0.1

    def get_logits(self, token_ids: Sequence[int], num_logits: int | None = None) -> torch.Tensor:
        """``[num_logits, V]`` logits predicting the token after each of the last positions.

        ``num_logits=None`` (the listing's call) returns every position's, ``[len(token_ids), V]``.
        """
        hidden = self.embedding[torch.tensor(list(token_ids))].cumsum(dim=0)
        logits = hidden @ self.lm_head
        return logits if num_logits is None else logits[-num_logits:]


def noisy_copy(model: SimpleLM, noise: float, seed: int = 0) -> SimpleLM:
    """A draft for ``model``: the same weights plus Gaussian noise, so the two mostly agree."""
    generator = torch.Generator().manual_seed(seed)
    draft = SimpleLM(model.vocab_size, model.embedding.shape[1], seed)
    draft.embedding = model.embedding + noise * torch.randn(model.embedding.shape, generator=generator)
    draft.lm_head = model.lm_head + noise * torch.randn(model.lm_head.shape, generator=generator)
    return draft


def acceptance_at_temperature(
    target: SimpleLM, draft: SimpleLM, temperature: float, with_q: bool, steps: int = 50, k: int = 4
) -> float:
    """Acceptance rate of ``steps`` verifications; ``with_q=False`` verifies as the listing did.

    Without the draft's probabilities, a draft counts as certain (one-hot ``q``) and is accepted
    with probability ``p(x)``: the listing's sample-and-compare. With them, ``min(1, p(x)/q(x))``.
    """
    generator = torch.Generator().manual_seed(0)
    accepted = 0
    for step in range(steps):
        context = [step % target.vocab_size, 7, 11]
        drafts, q = draft_generate(draft, context, k, temperature, generator)
        _, n = verify_and_sample(target, context, drafts, q if with_q else None, temperature, generator)
        accepted += n
    return accepted / (steps * k)


def main() -> None:
    target = SimpleLM(vocab_size=100)
    draft = noisy_copy(target, noise=0.02)
    context = [1, 2, 3, 4, 5]
    k = 5

    print("greedy, the listing's calls:")
    draft_tokens, draft_probs = draft_generate(draft, context, k, 0.0)
    print(f"  draft_generate          {draft_tokens}, q of shape {tuple(draft_probs.shape)}")
    tokens, num_accepted = verify_and_sample(target, context, draft_tokens, temperature=0.0)
    print(f"  verify_and_sample       {tokens}: {num_accepted} of {k} accepted, then one from the target")
    tokens, stats = speculative_decode_step(target, draft, context, k, 0.0)
    print(f"  speculative_decode_step {tokens} {stats}")
    out, totals = speculative_generate(target, draft, context, max_new_tokens=30, num_speculative_tokens=k)
    plain, _ = speculative_generate(target, None, context, max_new_tokens=30)
    print(f"  30 tokens in {totals.num_steps} target forwards; equal to plain greedy decoding: {out == plain}")

    print("temperature 1.0, acceptance of 4-token drafts:")
    for with_q, how in ((False, "the listing's sample-and-compare"), (True, "rejection sampling with q")):
        print(f"  {how:33} {acceptance_at_temperature(target, draft, 1.0, with_q):.1%}")


if __name__ == "__main__":
    main()
