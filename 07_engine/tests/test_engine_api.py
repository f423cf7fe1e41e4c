"""The engine's public contract: argument checking, the streaming interface, stops, aborts, stats."""

from __future__ import annotations

import pytest
import torch

from test_engine_parity import BLOCK, GREEDY, assert_no_leak, hf_greedy, make_prompts
from vllm_from_scratch import LLM, LLMEngine, RequestOutput, SamplingParams
from vllm_from_scratch.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
    )


@pytest.mark.parametrize(
    "prompt, name",
    [
        ([], "prompt"),
        (list(range(3, 131)), "max_model_len"),
        ([5, 512], "vocabulary"),
        ([5, -1], "vocabulary"),
        ("text", "token ids"),  # the tiny checkpoint has no tokenizer
    ],
)
def test_bad_prompt_raises_before_anything_is_scheduled(llm, prompt, name):
    good = [3, 4, 5]
    with pytest.raises(ValueError, match=name):
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the good prompt was not queued either
    assert llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"]  # and the engine still works
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.ignore_eos, p.stop, p.seed) == (
        1.0,
        1.0,
        -1,
        16,
        False,
        [],
        None,
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(device="cuda:7"), "device"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(kvcache_block_size=0), "kvcache_block_size"),
        (dict(max_model_len=10**6), "max_model_len"),
    ],
)
def test_bad_engine_arguments(tiny_llama_dir, kwargs, name):
    if kwargs.get("device") == "cuda:7" and torch.cuda.is_available():
        pytest.skip("a GPU is present: CUDA is a valid device here")
    with pytest.raises(ValueError, match=name):
        LLMEngine(tiny_llama_dir, **kwargs, enforce_eager=True)


@pytest.mark.parametrize("native_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_dtype_auto_on_a_cpu_is_bfloat16_only_where_it_is_native(monkeypatch, tiny_llama_dir, native_bf16, expected):
    from vllm_from_scratch import loader

    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native_bf16)
    loader._auto_dtype.cache_clear()  # the choice is made (and logged) once per process
    try:
        for dtype in ("auto", None):
            assert loader.resolve_dtype(dtype, "cpu") == expected
        engine = LLMEngine(tiny_llama_dir, device="cpu", num_kvcache_blocks=8, warm_up=False, enforce_eager=True)
        assert engine.config.torch_dtype == expected
    finally:
        loader._auto_dtype.cache_clear()


def test_streaming_outputs_add_up(llm, tiny_llama_dir):
    engine = llm.llm_engine
    prompt = make_prompts(10, (11,))[0]
    delta = GREEDY.clone(output_kind=RequestOutputKind.DELTA)
    rid = engine.add_request(prompt, delta, request_id="stream")
    pieces: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        pieces += engine.step()
    assert all(o.request_id == rid and len(o.outputs) == 1 for o in pieces)
    deltas = [o.outputs[0] for o in pieces]
    assert [t for c in deltas for t in c.token_ids] == hf_greedy(tiny_llama_dir, tuple(prompt))
    assert pieces[-1].finished and not any(o.finished for o in pieces[:-1])
    assert deltas[-1].finish_reason in ("stop", "length") and pieces[-1].prompt_token_ids == prompt
    # The same request with the default output kind: every record holds everything so far.
    engine.add_request(prompt, GREEDY, request_id="cumulative")
    cumulative = []
    while engine.has_unfinished_requests():
        cumulative += [o.outputs[0] for o in engine.step()]
    assert [c.token_ids for c in cumulative] == [
        [t for c in deltas[: i + 1] for t in c.token_ids] for i in range(len(deltas))
    ]
    assert [c.text for c in cumulative] == ["".join(c.text for c in deltas[: i + 1]) for i in range(len(deltas))]
    stats = engine.get_stats()
    assert stats["generation_tokens_total"] >= 2 * len(cumulative[-1].token_ids)
    assert set(stats) >= {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prompt_tokens_total",
        "num_preemptions_total",
    }


def test_duplicate_request_id(llm):
    engine = llm.llm_engine
    engine.add_request([3, 4], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([3, 4], GREEDY, request_id="dup")
    engine.abort_request("dup")
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    assert_no_leak(llm)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request(
        make_prompts(11, (30,))[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), request_id="a"
    )
    engine.add_request([7, 8, 9], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), request_id="b")
    engine.step()
    engine.step()
    assert engine.block_manager.usage > 0
    assert engine.abort_request("a") and not engine.abort_request("nope")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    done = {o.request_id: o for o in outs if o.finished}
    assert done["a"].outputs[0].finish_reason == "abort" and done["b"].outputs[0].finish_reason == "length"
    assert len(done["b"].outputs[0].token_ids) == 3
    assert_no_leak(llm)


def test_max_tokens_and_ignore_eos(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 7


def test_generation_stops_at_max_model_len(llm):
    prompt = list(range(3, 3 + 120))
    engine = llm.llm_engine
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), request_id="long")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (last,) = outs[-1].outputs
    assert len(last.token_ids) == 128 - 120 and last.finish_reason == "length"


def test_stop_token_ids_end_the_output(llm, tiny_llama_dir):
    prompt = make_prompts(12, (9,))[0]
    ref = hf_greedy(tiny_llama_dir, tuple(prompt))
    stop_at = ref[3]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert out["token_ids"] == ref[: ref.index(stop_at) + 1]
    assert_no_leak(llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0]["token_ids"]
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate([[9, 9], [3, 4, 5], [7]], [noise, params, noise], use_tqdm=False)[1]["token_ids"]
    assert alone == batched


def test_a_seeded_request_draws_on_the_engines_device(llm):
    """Its generator lives where the logits do (a CPU generator meeting CUDA noise is refused)."""
    engine = llm.llm_engine
    engine.add_request([3, 4, 5], SamplingParams(temperature=1.0, seed=5), request_id="seeded")
    req = engine.scheduler.requests["seeded"]
    assert req.generator is not None and req.generator.device.type == engine.config.torch_device.type
    engine.abort_request("seeded")
    engine.step()


@pytest.mark.cuda
def test_seeded_sampling_on_cuda_is_reproducible_whatever_the_batch(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cuda", kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32")
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0]["token_ids"]
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate([[9, 9], [3, 4, 5], [7]], [noise, params, noise], use_tqdm=False)[1]["token_ids"]
    assert alone == batched


def test_priority_scheduling_from_generate(tiny_llama_dir):
    """One request runs at a time: under "priority" the lower values finish first, whatever the order
    they were given in; under "fcfs" the order given wins."""
    prompts = make_prompts(13, (6, 7, 8, 9))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    finish_order = {}
    for policy in ("fcfs", "priority"):
        engine = LLMEngine(
            tiny_llama_dir,
            kvcache_block_size=BLOCK,
            num_kvcache_blocks=64,
            dtype="float32",
            max_num_seqs=1,
            scheduling_policy=policy,
            enforce_eager=True,
        )
        for i, (p, prio) in enumerate(zip(prompts, [3, 1, 2, 0])):
            engine.add_request(p, params, request_id=str(i), priority=prio)
        done = []
        while engine.has_unfinished_requests():
            done += [o.request_id for o in engine.step() if o.finished]
        finish_order[policy] = done
    assert finish_order == {"fcfs": ["0", "1", "2", "3"], "priority": ["3", "1", "2", "0"]}
    llm = LLM(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        scheduling_policy="priority",
        enforce_eager=True,
    )
    outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[1, 0])
    assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_llama_dir, tuple(p)) for p in prompts[:2]]
    with pytest.raises(ValueError, match="priority"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, priority=["high"])
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
        (dict(attention_backend="cuda"), "attention_backend"),
        (dict(long_prefill_token_threshold=0), "long_prefill_token_threshold"),
    ],
)
def test_bad_scheduling_settings(tiny_llama_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLMEngine(tiny_llama_dir, **kwargs, enforce_eager=True)


def test_chapter_knobs_reach_the_scheduler_and_the_attention_layers(tiny_llama_dir):
    engine = LLMEngine(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        long_prefill_token_threshold=5,
        attention_backend="torch",
        scheduling_policy="priority",
        enforce_eager=True,
    )
    assert engine.scheduler.long_prefill_token_threshold == 5 and engine.scheduler.policy == "priority"
    assert {a.backend for a in engine.executor.runner.attn_layers} == {"torch"}
    engine.add_request(make_prompts(14, (12,))[0], GREEDY, request_id="chunked")
    engine.step()
    assert engine.scheduler.requests["chunked"].num_computed_tokens == 5
