"""Logprobs (sampled, top-k and prompt) equal transformers' log-softmax, in vLLM's shape.

Tiny random Llama and Qwen3 checkpoints, float32, a batch that mixes requests with and without
logprobs, with prefix caching, chunked prefill and preemption each switched on. vLLM V1 reports
the raw model distribution (before penalties, temperature, top-k and top-p), so sampled rows
with those settings still match transformers' plain log-softmax.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.outputs import Logprob

BLOCK = 8
K = 5
ATOL = 1e-4  # float32: the engine's paged attention and transformers' sum in different orders

FEATURES = {
    "plain": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "prefix_caching": dict(enable_prefix_caching=True, enable_chunked_prefill=False),
    "chunked_prefill": dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=16),
    "preemption": dict(enable_prefix_caching=False, enable_chunked_prefill=False, num_kvcache_blocks=9),
}


@functools.cache
def _hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), V]``: row ``p`` is transformers' log-softmax predicting token ``p + 1``."""
    return _hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def check_position(entry: dict[int, Logprob], reference: torch.Tensor, token: int, k: int, where: str) -> None:
    """``entry`` holds ``token`` and the ``k`` most likely tokens, with transformers' values and ranks."""
    top = reference.topk(k).indices.tolist()
    assert set(entry) == {token, *top}, f"{where}: tokens {sorted(entry)}, expected {sorted({token, *top})}"
    for t, lp in entry.items():
        assert isinstance(lp, Logprob)
        assert abs(lp.logprob - float(reference[t])) < ATOL, f"{where}: token {t}"
        assert lp.rank == int((reference >= reference[t]).sum()), f"{where}: rank of token {t}"
    for rank, t in enumerate(top, 1):
        assert entry[t].rank == rank


def prompts_for(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (11, 19, 30)]


@pytest.fixture(params=["llama", "qwen3"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.mark.parametrize("feature", list(FEATURES))
def test_logprobs_match_transformers(model_dir, feature, monkeypatch):
    if feature == "plain":  # prompt logits a few rows at a time, slices crossing requests
        monkeypatch.setattr("vllm_from_scratch.model_runner.PROMPT_LOGITS_SLICE", 7)
    kwargs = dict(kvcache_block_size=BLOCK, dtype="float32", device="cpu", num_kvcache_blocks=256)
    kwargs.update(FEATURES[feature])
    llm = LLM(model_dir, **kwargs, enforce_eager=True)
    prompts = prompts_for(0)
    params = [
        # Sampled with settings that change the sampling distribution, not the reported one.
        SamplingParams(
            temperature=0.8, top_k=20, seed=1, max_tokens=12, logprobs=K, prompt_logprobs=K, repetition_penalty=1.3
        ),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, prompt_logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    rounds = 2 if feature == "prefix_caching" else 1
    for _ in range(rounds):  # the second round's prompts are all in the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, sp, out in zip(prompts, params, outs):
            completion = out.outputs[0]
            if sp.logprobs is None:
                assert completion.logprobs is None and completion.cumulative_logprob is None
            if sp.prompt_logprobs is None:
                assert out.prompt_logprobs is None
            if sp.logprobs is None and sp.prompt_logprobs is None:
                continue
            reference = hf_logprobs(model_dir, prompt + completion.token_ids)
            if sp.logprobs is not None:
                assert completion.logprobs is not None
                assert len(completion.logprobs) == len(completion.token_ids)
                for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
                    check_position(entry, reference[len(prompt) + j - 1], token, sp.logprobs, f"output {j}")
                expected = sum(float(reference[len(prompt) + j - 1, t]) for j, t in enumerate(completion.token_ids))
                assert completion.cumulative_logprob == pytest.approx(expected, abs=ATOL * len(completion.token_ids))
            if sp.prompt_logprobs is not None:
                assert out.prompt_logprobs is not None
                assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
                assert out.num_cached_tokens == 0, "prompt_logprobs recomputes the prompt"
                for p in range(1, len(prompt)):
                    entry = out.prompt_logprobs[p]
                    assert entry is not None, f"prompt position {p} was never scored"
                    check_position(entry, reference[p - 1], prompt[p], sp.prompt_logprobs, f"prompt {p}")
    stats = llm.llm_engine.get_stats()
    if feature == "prefix_caching":
        assert stats["prefix_cache_hits"] > 0, "requests without prompt_logprobs still take hits"
    if feature == "preemption":
        assert stats["num_preemptions_total"] > 0, "the cache was meant to be too small for the batch"
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_invariants()
    assert engine.block_manager.all_blocks_free()
    llm.shutdown()


def test_logprobs_fields_validate_by_name(tiny_llama_dir):
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ParameterError) as info:
            SamplingParams(**{name: -1})
        assert info.value.param == name
    llm = LLM(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        device="cpu",
        enforce_eager=True,
    )
    try:
        with pytest.raises(ParameterError) as info:
            llm.generate([[5, 6, 7]], SamplingParams(logprobs=513), use_tqdm=False)
        assert info.value.param == "logprobs"
    finally:
        llm.shutdown()


def test_speculative_decoding_refuses_logprobs(tiny_llama_dir):
    llm = LLM(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        device="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        enforce_eager=True,
    )
    try:
        for name in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ParameterError) as info:
                llm.generate([[5, 6, 7]], SamplingParams(**{name: 1}), use_tqdm=False)
            assert info.value.param == name
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_logprobs_under_tensor_parallelism(tiny_llama_dir):
    """Two gloo ranks: every rank computes the prompt rows' logits (the vocabulary gather is a
    collective), rank 0 scores them."""
    llm = LLM(
        tiny_llama_dir,
        tensor_parallel_size=2,
        device="cpu",
        dtype="float32",
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        max_num_batched_tokens=16,
        enforce_eager=True,
    )
    try:
        prompt = prompts_for(3)[2]
        sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=K, prompt_logprobs=K)
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        completion = out.outputs[0]
        reference = hf_logprobs(tiny_llama_dir, prompt + completion.token_ids)
        assert completion.logprobs is not None and out.prompt_logprobs is not None
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(entry, reference[len(prompt) + j - 1], token, K, f"output {j}")
        for p in range(1, len(prompt)):
            entry = out.prompt_logprobs[p]
            assert entry is not None
            check_position(entry, reference[p - 1], prompt[p], K, f"prompt {p}")
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_default_model_logprobs_carry_decoded_tokens_and_min_tokens_holds_stop_strings():
    """A real tokenizer: each entry's ``decoded_token`` is the token decoded alone (vLLM's
    ``convert_ids_list_to_tokens``), and ``min_tokens`` keeps stop strings from ending the text
    early (vLLM checks them only once more than ``min_tokens`` tokens are out)."""
    from vllm_from_scratch import default_model_dir

    model_dir = default_model_dir()
    llm = LLM(model_dir, dtype="float32", num_kvcache_blocks=64, max_model_len=512, warm_up=False, enforce_eager=True)
    try:
        tok = llm.get_tokenizer()
        assert tok is not None
        prompt = "The capital of France is"
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2))[0]
        completion = out.outputs[0]
        assert completion.logprobs is not None and out.prompt_logprobs is not None
        for entry in [*completion.logprobs, *out.prompt_logprobs[1:]]:
            assert entry is not None
            for t, lp in entry.items():
                assert lp.decoded_token == tok.decode([t])
        reference = hf_logprobs(model_dir, out.prompt_token_ids + completion.token_ids)
        n = len(out.prompt_token_ids)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(entry, reference[n + j - 1], token, 3, f"output {j}")
        first_word = completion.text.split()[0]
        held = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop=[first_word], min_tokens=8))
        assert held[0].outputs[0].text == completion.text, "the stop string matched before min_tokens"
    finally:
        llm.shutdown()
