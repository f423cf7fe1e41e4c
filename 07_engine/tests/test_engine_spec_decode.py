"""Speculative decoding in the engine (chapter 05's proposers and rejection sampler).

Greedy output must not change, whether drafts are mostly right (a draft model identical to the
target, an n-gram lookup on a repetitive prompt) or mostly wrong (an unrelated draft model).
"""

from __future__ import annotations

import pytest
import torch

from test_engine_parity import BLOCK, GREEDY, assert_no_leak, hf_greedy, make_prompts
from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.sampler import SamplingMetadata
from vllm_from_scratch.spec_decoding import RejectionSampler


def test_verify_drafts_keeps_the_agreeing_prefix_then_one_token():
    """Greedy rows: a's first draft agrees with the target, its second does not; b has no drafts."""
    V = 512
    logits = torch.zeros(4, V)
    for row, token in enumerate([11, 40, 99, 5]):  # a: agrees with 11, says 40 instead of 12; b: 5
        logits[row, token] = 10.0
    metadata = SamplingMetadata(torch.zeros(4), None, None, None, ["a", "b"], [None, None])
    sampler = RejectionSampler(torch.device("cpu"), V)
    assert sampler.verify_drafts(logits, metadata, [[11, 12], []]) == {"a": [11, 40], "b": [5]}
    assert sampler.sample(logits, metadata, [[11, 12], []]).sampled_token_ids == {"a": [11, 40], "b": [5]}


def _spec_llm(model_dir, spec, **kw):
    return LLM(
        model_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=128,
        dtype="float32",
        speculative_config=spec,
        **kw,
        enforce_eager=True,
    )


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_keeps_greedy_output(tiny_llama_dir, tiny_qwen3_dir, draft):
    draft_dir = tiny_llama_dir if draft == "same" else tiny_qwen3_dir
    llm = _spec_llm(tiny_llama_dir, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3})
    prompts = make_prompts(5, (7, 19, 30))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o["token_ids"] == hf_greedy(tiny_llama_dir, tuple(p))
    stats = llm.llm_engine.get_stats()
    drafts, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafts > 0
    if draft == "same":  # the target agrees with itself: every draft is accepted
        assert accepted == drafts
    else:
        assert accepted < drafts
    assert_no_leak(llm)


def test_ngram_keeps_greedy_output_with_chunks_and_prefix_cache(tiny_qwen3_dir):
    llm = _spec_llm(tiny_qwen3_dir, {"method": "ngram", "num_speculative_tokens": 4}, max_num_batched_tokens=16)
    base = make_prompts(6, (6,))[0]
    prompts = [base * 4, make_prompts(7, (23,))[0], base * 2 + [5, 6]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o["token_ids"] == hf_greedy(tiny_qwen3_dir, tuple(p))
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert_no_leak(llm)


def test_sampled_spec_decoding_runs_and_frees_blocks(tiny_llama_dir):
    llm = _spec_llm(tiny_llama_dir, {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3)
    a = llm.generate(make_prompts(8, (10, 12)), params, use_tqdm=False)
    assert all(len(o["token_ids"]) >= 1 for o in a)
    assert all(0 <= t < 512 for o in a for t in o["token_ids"])
    assert_no_leak(llm)


def test_a_seeded_requests_rejection_noise_is_its_own_whatever_the_batch():
    """Its uniforms are sized by its own drafts, not the batch's padded K, so its generator
    advances alike in any batch: the next step's noise matches too."""
    sampler = RejectionSampler(torch.device("cpu"), 64)
    alone_gen, batched_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(2):
        alone = sampler.rejection_noise([2], 2, 64, [alone_gen])
        batched = sampler.rejection_noise([4, 2, 0], 4, 64, [None, batched_gen, None])
        assert torch.equal(alone.uniform[0, :2], batched.uniform[1, :2])
        assert torch.equal(alone.exponential[0], batched.exponential[1])


def test_seeded_spec_decoding_ignores_the_rest_of_the_batch(tiny_llama_dir):
    """A seeded request draws its acceptance uniforms and its exponential row from its own
    generator, sized by its own drafts, not by the batch's longest; and whether the others
    drafted (the global generator decides their tokens, so each seed below makes a different
    batch) never changes how it samples a step in which it has no drafts."""
    llm = _spec_llm(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3})
    base = make_prompts(9, (5,))[0]
    seeded = SamplingParams(temperature=0.9, max_tokens=12, seed=11, ignore_eos=True)
    other = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    alone = llm.generate([base * 3], seeded, use_tqdm=False)[0]["token_ids"]
    batch = [make_prompts(10, (7,))[0] * 4, base * 3, [4, 5]]
    for global_seed in range(6):
        torch.manual_seed(global_seed)
        batched = llm.generate(batch, [other, seeded, other], use_tqdm=False)[1]["token_ids"]
        assert alone == batched, f"global seed {global_seed}: the seeded request's tokens changed with the batch"
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "spec, name",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
    ],
)
def test_bad_speculative_config_names_the_key(tiny_llama_dir, spec, name):
    with pytest.raises(ValueError, match=name):
        _spec_llm(tiny_llama_dir, spec)
