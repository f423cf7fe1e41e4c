"""Seed 000's speculative-decoding listing runs against the chapter (seed_listing.py, README)."""

import pytest
import torch

from seed_listing import SimpleLM, acceptance_at_temperature, main, noisy_copy
from spec_decode import LogitsModel, draft_generate, speculative_decode_step, speculative_generate, verify_and_sample

VOCAB = 50
CONTEXT = [1, 2, 3, 4, 5]


@pytest.fixture
def models():
    target = SimpleLM(VOCAB)
    return target, noisy_copy(target, noise=0.02)


def greedy(model, context, n):
    ids = list(context)
    for _ in range(n):
        ids.append(int(model.get_logits(ids, 1)[-1].argmax()))
    return ids[len(context) :]


def test_simple_lm_answers_the_listings_call_and_the_chapters():
    model = SimpleLM(VOCAB)
    every = model.get_logits(CONTEXT)
    assert every.shape == (len(CONTEXT), VOCAB)
    assert torch.equal(model.get_logits(CONTEXT, 2), every[-2:])
    assert isinstance(model, LogitsModel)
    assert torch.equal(SimpleLM(VOCAB).lm_head, model.lm_head)  # the seed fixes the weights


def test_the_listings_flow_greedy(models):
    target, draft = models
    draft_tokens, draft_probs = draft_generate(draft, CONTEXT, 4, 0.0)  # the listing's call
    assert len(draft_tokens) == 4 and draft_probs.shape == (4, VOCAB)
    tokens, num_accepted = verify_and_sample(target, CONTEXT, draft_tokens, temperature=0.0)
    assert len(tokens) == num_accepted + 1
    assert tokens == greedy(target, CONTEXT, len(tokens))

    tokens, stats = speculative_decode_step(target, draft, CONTEXT, 4, 0.0)  # the listing's call
    assert tokens == greedy(target, CONTEXT, len(tokens))
    assert stats["num_emitted"] == len(tokens) == stats["num_accepted"] + 1
    assert stats["acceptance_rate"] == stats["num_accepted"] / stats["num_draft"]


def test_generation_through_the_listings_step_equals_greedy_decoding(models):
    target, draft = models
    out, stats = speculative_generate(target, draft, CONTEXT, max_new_tokens=24, num_speculative_tokens=4)
    assert out == greedy(target, CONTEXT, 24)
    assert stats.num_steps < 24


def test_the_listings_positional_temperature_is_refused(models):
    target, draft = models
    drafts, _ = draft_generate(draft, CONTEXT, 3, 0.0)
    with pytest.raises(TypeError, match="temperature="):
        verify_and_sample(target, CONTEXT, drafts, 0.0)


def test_rejection_sampling_accepts_far_more_than_sample_and_compare(models):
    target, draft = models
    listing = acceptance_at_temperature(target, draft, 1.0, with_q=False)
    chapter = acceptance_at_temperature(target, draft, 1.0, with_q=True)
    assert listing < 0.1 < 0.8 < chapter


def test_the_script_runs(capsys):
    main()
    assert "equal to plain greedy decoding: True" in capsys.readouterr().out
