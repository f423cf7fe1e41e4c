"""vLLM's sampling fields: penalties, min_p, min_tokens and logit_bias, each checked against a
plain per-row Python version of vLLM V1's rule on random logits, then through the engine."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.sampler import SamplingMetadata, apply_logits_processors

V = 40
EOS = 2


def _request(params: SamplingParams, prompt: list[int], output: list[int], rid: str = "r") -> SimpleNamespace:
    """What ``SamplingMetadata.from_requests`` reads of an engine request."""
    stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else {EOS})
    return SimpleNamespace(
        request_id=rid,
        sampling_params=params,
        generator=None,
        prompt_token_ids=prompt,
        completion_token_ids=output,
        num_completion_tokens=len(output),
        stop_token_ids=frozenset(stops),
    )


def _reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM V1's rules for one row, one token at a time, in its order."""
    out = list(logits)
    stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else {EOS})
    if len(output) < params.min_tokens:
        for t in stops:
            out[t] = -math.inf
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        count = output.count(t)
        out[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    if params.min_p > 0 and params.temperature >= 1e-5:
        scaled = [x / params.temperature for x in out]
        top = max(scaled)
        probs = [math.exp(x - top) for x in scaled]
        total = sum(probs)
        probs = [p / total for p in probs]
        out = [-math.inf if p < params.min_p * max(probs) else x for x, p in zip(out, probs)]
    return out


CASES = {
    "presence": SamplingParams(presence_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=-0.7),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "repetition_below_one": SamplingParams(repetition_penalty=0.5),
    "min_p": SamplingParams(min_p=0.2, temperature=0.7),
    "min_tokens": SamplingParams(min_tokens=5, stop_token_ids=[7, 9]),
    "min_tokens_ignore_eos": SamplingParams(min_tokens=5, stop_token_ids=[7], ignore_eos=True),
    "logit_bias": SamplingParams(logit_bias={3: 5.0, 11: -100.0, 0: 0.5}),
    "all": SamplingParams(
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        min_p=0.05,
        min_tokens=4,
        logit_bias={5: 2.0},
        temperature=1.3,
    ),
}


def test_each_field_matches_a_per_row_reference_in_one_batch():
    """Every case as one row of a single batch, beside default rows that must stay untouched."""
    gen = torch.Generator().manual_seed(0)
    rows = list(CASES.items()) + [("default", SamplingParams()), ("greedy", SamplingParams(temperature=0.0))]
    requests, expected = [], []
    logits = torch.randn(len(rows), V, generator=gen) * 3
    for i, (name, params) in enumerate(rows):
        prompt = torch.randint(0, V, (12,), generator=gen).tolist()
        output = torch.randint(0, V, (3 + i % 4,), generator=gen).tolist()
        requests.append(_request(params, prompt, output, name))
        expected.append(_reference(logits[i].tolist(), params, prompt, output))
    sampling = SamplingMetadata.from_requests(requests, [1] * len(rows), V, "cpu")
    before = logits.clone()
    got = apply_logits_processors(logits, sampling)
    assert torch.equal(logits, before), "the processors must not change the model's logits in place"
    for i, (name, _) in enumerate(rows):
        torch.testing.assert_close(got[i], torch.tensor(expected[i]), msg=f"row {name!r}")


def test_no_field_in_use_means_no_work():
    logits = torch.randn(3, V)
    requests = [_request(SamplingParams(temperature=t), [1], []) for t in (0.0, 0.5, 1.0)]
    sampling = SamplingMetadata.from_requests(requests, [1, 1, 1], V, "cpu")
    assert not sampling.has_processors
    assert apply_logits_processors(logits, sampling) is logits


def test_min_p_never_drops_the_most_likely_token():
    logits = torch.randn(4, V)
    requests = [_request(SamplingParams(min_p=1.0, temperature=t), [1], []) for t in (0.0, 0.3, 1.0, 2.0)]
    got = apply_logits_processors(logits, SamplingMetadata.from_requests(requests, [1] * 4, V, "cpu"))
    assert torch.equal(got.argmax(-1), logits.argmax(-1))
    assert bool((got[1:] > float("-inf")).sum(-1).eq(1).all()), "min_p=1 keeps only the argmax when sampling"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17, max_tokens=16), "min_tokens"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={1: float("nan")}), "logit_bias"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and str(info.value).startswith(field)


def test_logit_bias_reads_json_keys_and_clamps_like_vllm():
    params = SamplingParams(logit_bias={"5": 300, 6: -250.0})
    assert params.logit_bias == {5: 100.0, 6: -100.0}


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(
        tiny_llama_dir, kvcache_block_size=8, num_kvcache_blocks=64, dtype="float32", device="cpu", enforce_eager=True
    )
    yield engine
    engine.shutdown()


PROMPT = [5, 17, 33, 4, 99, 250, 7, 61, 12]


def test_engine_checks_logit_bias_ids_against_the_vocabulary(llm):
    with pytest.raises(ParameterError) as info:
        llm.generate([PROMPT], SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
    assert info.value.param == "logit_bias"


def test_logit_bias_steers_greedy_output(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logit_bias={42: 100.0}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [42] * 6


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    # EOS (and stop token 9) favoured by a large bias: the request ends at once without
    # min_tokens, and right after 4 tokens with it.
    short = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    completion = llm.generate([PROMPT], short, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == [EOS] and completion.finish_reason == "stop"
    held = SamplingParams(
        temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0, 9: 100.0}, min_tokens=4, stop_token_ids=[9]
    )
    completion = llm.generate([PROMPT], held, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 5 and not {EOS, 9} & set(completion.token_ids[:4])
    assert completion.token_ids[4] in (EOS, 9) and completion.finish_reason == "stop"


def test_penalties_change_greedy_output_as_the_reference_says(llm):
    """Greedy with a strong repetition penalty never repeats a token while fresh ones remain."""
    params = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1e6)
    ids = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(ids)) == len(ids) and not set(ids) & set(PROMPT), ids


@pytest.mark.parametrize(
    "features",
    [
        dict(enable_prefix_caching=False, enable_chunked_prefill=False),
        # Chunked prefill, prefix caching and a cache too small for the batch (preemption):
        # the counts must follow each request's own tokens through all of it.
        dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16, num_kvcache_blocks=9),
    ],
    ids=["plain", "all"],
)
def test_greedy_with_every_processor_equals_a_transformers_loop(tiny_qwen3_dir, features):
    """Each step's logits from transformers, through the per-row reference, then argmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 21, 30)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.7, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, presence_penalty=-1.0, min_p=0.3),
    ]
    kwargs = dict(kvcache_block_size=8, num_kvcache_blocks=64, dtype="float32", device="cpu") | features
    llm = LLM(tiny_qwen3_dir, **kwargs, enforce_eager=True)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if "num_kvcache_blocks" in features:
            assert llm.llm_engine.get_stats()["num_preemptions_total"] > 0, "the cache was meant to be too small"
    finally:
        llm.shutdown()
    for prompt, sp, out in zip(prompts, params, outs):
        expected: list[int] = []
        with torch.no_grad():
            for _ in range(len(out.outputs[0].token_ids)):
                logits = hf(torch.tensor([prompt + expected])).logits[0, -1].tolist()
                processed = _reference(logits, sp, prompt, expected)
                expected.append(max(range(len(processed)), key=processed.__getitem__))
        assert out.outputs[0].token_ids == expected, sp


def test_speculative_decoding_refuses_penalties_and_min_tokens(tiny_llama_dir):
    spec = LLM(
        tiny_llama_dir,
        kvcache_block_size=8,
        num_kvcache_blocks=64,
        dtype="float32",
        device="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        enforce_eager=True,
    )
    try:
        for field, value in (("presence_penalty", 0.5), ("repetition_penalty", 1.2), ("min_tokens", 2)):
            with pytest.raises(ParameterError) as info:
                spec.generate([PROMPT], SamplingParams(**{field: value}), use_tqdm=False)
            assert info.value.param == field
        # logit_bias and min_p are per-row constants: they compose with drafts.
        out = spec.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100.0}), use_tqdm=False
        )
        assert out[0].outputs[0].token_ids == [42] * 4
    finally:
        spec.shutdown()
