"""The engine as it runs on a GPU, run on the CPU: every branch whose logic is not CUDA itself.

An engine whose runner has a GPU platform (``gpu_standin.py``: the allocator's numbers chosen,
decode graphs that replay eagerly) sizes its KV cache by profiling, captures decode graphs
and replays every pure decode step from them, padded to a captured size. Its greedy tokens must
equal transformers'.

Device placement: each step runs with ``meta`` as the default device, so a tensor that a step
makes without naming its device lands on ``meta``, where it can neither meet the step's CPU
tensors nor yield a value: the test fails where, on a GPU, a CPU tensor would have met CUDA ones.
Tensors built on the host on purpose say ``device="cpu"``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_standin import StandInMemory, cpu_gpu_platform, recorded_forwards
from test_engine_parity import BLOCK, GREEDY, assert_no_leak, assert_parity, make_prompts
from vllm_from_scratch import LLM, SamplingParams, engine
from vllm_from_scratch.model_runner import ModelRunner

VOCAB = 512  # the tiny checkpoints' (conftest.save_tiny_checkpoint)


def gpu_platform_llm(model_dir: str, **kwargs) -> LLM:
    """An ``LLM`` whose runner takes the GPU branches on the CPU. The engine builds its runner as
    ``ModelRunner(config)``; the platform is handed to that constructor, nothing is patched after."""
    # A pretend 4 MB card, 0.5 MB in use, steps peaking 0.2 MB above rest: room for 100+ blocks.
    memory = StandInMemory(total=4_000_000, free=3_500_000, allocated=0, peaks=[200_000, 100_000])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "ModelRunner", functools.partial(ModelRunner, gpu=cpu_gpu_platform(memory)))
        settings = dict(device="cpu", dtype="float32", kvcache_block_size=BLOCK, max_num_seqs=8, max_model_len=128)
        return LLM(model_dir, **(settings | kwargs))


@pytest.fixture(scope="module")
def gpu_llm(tiny_llama_dir):
    llm = gpu_platform_llm(tiny_llama_dir, max_num_batched_tokens=256)
    yield llm
    llm.shutdown()


def test_the_engine_sizes_its_cache_and_replays_decode_graphs(gpu_llm, tiny_llama_dir):
    runner = gpu_llm.llm_engine.executor.runner
    assert runner.memory_profile["kv_budget"] > 0 and runner.graph_runner is not None
    assert runner.compiled_forward is None
    assert runner.num_kvcache_blocks == gpu_llm.llm_engine.block_manager.num_blocks
    prompts = make_prompts(3, lengths=(5, 9, 17))
    with recorded_forwards() as forwards:
        assert_parity(gpu_llm, tiny_llama_dir, prompts)
    # Three requests decode together as a graph of 4 rows (one padding row), then 2 and 1 as they end.
    assert 4 in forwards and 3 not in forwards


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_the_gpu_branches_places_every_tensor(tiny_llama_dir, method):
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        spec["model"] = tiny_llama_dir
    llm = gpu_platform_llm(tiny_llama_dir, speculative_config=spec, warm_up=False)
    repeating = [[7, 8, 9, 10] * 4, [11, 12, 13] * 3, [5, 6]]
    with torch.device("meta"):
        outs = llm.generate(repeating, GREEDY, use_tqdm=False)
    assert all(len(o["token_ids"]) == GREEDY.max_tokens for o in outs)
    assert_no_leak(llm)
    llm.shutdown()


@st.composite
def sampling(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, 6))
    return draw(_sampling(max_tokens=st.just(max_tokens), min_tokens=st.integers(0, max_tokens)))


_sampling = functools.partial(
    st.builds,
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    top_k=st.sampled_from([-1, 1, 5, 50]),
    min_p=st.sampled_from([0.0, 0.1]),
    seed=st.none() | st.integers(0, 2**31),
    n=st.integers(1, 2),
    logprobs=st.none() | st.integers(0, 3),
    prompt_logprobs=st.none() | st.integers(0, 2),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, -0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    logit_bias=st.none() | st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5), max_size=2),
)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40), sampling()), min_size=1, max_size=5
    )
)
def test_every_tensor_a_step_makes_is_placed_on_the_runners_device(gpu_llm, requests):
    """Whatever the requests ask for (sampling settings, seeds, penalties, biases, log-probs of
    prompt and output, several completions), no step makes a tensor without naming its device."""
    prompts = [p for p, _ in requests]
    params = [s for _, s in requests]
    with torch.device("meta"):
        outs = gpu_llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert min(p.min_tokens, p.max_tokens) <= len(completion.token_ids) <= p.max_tokens
            assert all(0 <= t < VOCAB for t in completion.token_ids)
    assert_no_leak(gpu_llm)


def test_a_tensor_made_without_a_device_fails_the_check():
    """The check itself: under ``meta`` a forgotten device fails at once."""
    host = torch.arange(4, device="cpu")
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        (host + torch.arange(4)).tolist()
