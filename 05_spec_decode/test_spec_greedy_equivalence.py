"""Greedy decoding with speculation equals greedy decoding without it, token for token.

The reference is transformers' own ``generate(do_sample=False)``; the speculative loop verifies
with the same checkpoint through :class:`HFCausalLM` and any proposer.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from proposers import DraftModelProposer, HFCausalLM, NgramProposer, make_truncated_draft
from spec_decode import speculative_decode_step

NEW_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 250, 17, 99], [300, 42, 7, 7, 7, 18, 300, 42, 7, 11, 64, 9]]


def _reference(model_dir, prompt):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _speculative(target, proposer, prompt, k):
    ctx = list(prompt)
    steps = 0
    while len(ctx) - len(prompt) < NEW_TOKENS:
        tokens, _ = speculative_decode_step(target, proposer, ctx, k)
        ctx += tokens
        steps += 1
    return ctx[len(prompt) : len(prompt) + NEW_TOKENS], steps


@pytest.fixture(scope="module")
def truncated_draft_dir(tiny_llama_dir, tmp_path_factory):
    return make_truncated_draft(tiny_llama_dir, 1, tmp_path_factory.mktemp("draft") / "d")


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_unchanged_with_a_truncated_draft_model(tiny_llama_dir, truncated_draft_dir, k):
    target = HFCausalLM(tiny_llama_dir)
    proposer = DraftModelProposer(truncated_draft_dir)
    for prompt in PROMPTS:
        got, _ = _speculative(target, proposer, prompt, k)
        assert got == _reference(tiny_llama_dir, prompt)


def test_greedy_unchanged_with_an_unrelated_draft_model(tiny_llama_dir, tmp_path):
    # A different random checkpoint: almost every draft is rejected, output must not change.
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    target = HFCausalLM(tiny_llama_dir)
    got, _ = _speculative(target, DraftModelProposer(other), PROMPTS[0], 3)
    assert got == _reference(tiny_llama_dir, PROMPTS[0])


def test_greedy_unchanged_with_ngram_drafts(tiny_llama_dir, tiny_qwen3_dir):
    for model_dir in (tiny_llama_dir, tiny_qwen3_dir):
        target = HFCausalLM(model_dir)
        for prompt in PROMPTS:
            got, _ = _speculative(target, NgramProposer(1, 3), prompt, 3)
            assert got == _reference(model_dir, prompt)


def test_draft_equal_to_target_needs_one_forward_per_k_plus_one_tokens(tiny_llama_dir):
    target = HFCausalLM(tiny_llama_dir)
    got, steps = _speculative(target, DraftModelProposer(target.model), PROMPTS[1], 5)
    assert got == _reference(tiny_llama_dir, PROMPTS[1])
    assert steps == -(-NEW_TOKENS // 6)
