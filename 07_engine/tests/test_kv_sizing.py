"""Sizing the KV cache on a GPU as nano-vllm does: measure the largest step, then give the cache
what is left of ``total × gpu_memory_utilization``.

The arithmetic and the profiling run are checked on the CPU through the runner's own constructor,
given a GPU platform whose memory probes are a stand-in (``gpu_standin.py``); the ``cuda``-marked
test measures a real card.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_standin import StandInMemory, cpu_gpu_platform, recorded_forwards
from kv_cache import bytes_per_block
from test_engine_parity import BLOCK
from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.model_runner import ModelRunner, kv_cache_budget

GiB = 2**30


def test_kv_budget_is_the_cards_share_less_what_is_used_and_the_peaks():
    # An 80 GiB card, 1.5 GiB in use (weights, CUDA context), a 1 GiB step peak, a 0.25 GiB graph pool.
    budget = kv_cache_budget(80 * GiB, 78 * GiB + GiB // 2, GiB, 0.9, graph_pool=GiB // 4)
    assert budget == int(80 * GiB * 0.9) - (GiB + GiB // 2) - GiB - GiB // 4
    assert kv_cache_budget(GiB, GiB // 10, GiB // 2, 0.9) == 0  # nothing left: zero, not negative


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(total=-1), "total"),
        (dict(free=2 * GiB), "free"),
        (dict(activation_peak=1.5), "activation_peak"),
        (dict(utilization=0.0), "utilization"),
        (dict(graph_pool=-5), "graph_pool"),
    ],
)
def test_kv_budget_names_a_bad_argument(kwargs, name):
    args = dict(total=GiB, free=GiB // 2, activation_peak=0, utilization=0.9) | kwargs
    with pytest.raises(ValueError, match=name):
        kv_cache_budget(**args)


def _config(model_dir: str, **overrides) -> EngineConfig:
    settings = dict(
        device="cpu",
        dtype="float32",
        kvcache_block_size=BLOCK,
        max_model_len=64,
        max_num_batched_tokens=100,
        max_num_seqs=20,
    )
    return EngineConfig(model_dir, **(settings | overrides))


def _layout_bytes(runner: ModelRunner) -> int:
    return bytes_per_block(*runner._block_layout())


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("spec_k", [0, 3])
def test_the_gpu_sizing_runs_through_the_constructor(tiny_llama_dir, spec_k, enforce_eager):
    """``num_kvcache_blocks=None`` on a GPU platform: the constructor profiles the largest steps
    (the whole token budget as prompts, the most sampling rows a step can have, times k + 1 with
    drafts, and, with decode graphs, the largest graph's forward), sizes the cache from the
    allocator's numbers, and only then captures the graphs, on the cache it sized."""
    spec = {"method": "ngram", "num_speculative_tokens": spec_k} if spec_k else None
    cfg = _config(tiny_llama_dir, speculative_config=spec, enforce_eager=enforce_eager)
    # A pretend 2 MB card with 0.6 MB in use; the steps peak 0.6 MB above the 0.1 MB at rest, the
    # largest decode graph's forward 0.3 MB above it.
    memory = StandInMemory(total=2_000_000, free=1_400_000, allocated=100_000, peaks=[700_000, 400_000])
    with recorded_forwards() as forwards:
        runner = ModelRunner(cfg, gpu=cpu_gpu_platform(memory))
    sample_rows = min(100, 20 * (1 + spec_k))
    graphs = [] if enforce_eager else [20]
    # The budget as prompts of at most max_model_len (64 + 36 tokens), the sampling rows, the largest
    # graph's forward; then the capture's own forwards (padding rows only), largest first.
    captures = [] if enforce_eager else [20, 16, 8, 4, 2, 1]
    assert forwards == [100, sample_rows, *graphs, *captures]
    graph_pool = 0 if enforce_eager else 300_000
    budget = kv_cache_budget(2_000_000, 1_400_000, 600_000, 0.9, graph_pool)
    assert runner.memory_profile == dict(
        total=2_000_000,
        free=1_400_000,
        weights_and_context=600_000,
        activation_peak=600_000,
        graph_pool=graph_pool,
        kv_budget=budget,
    )
    assert budget > 0 and runner.num_kvcache_blocks == budget // _layout_bytes(runner)
    assert runner.kv_cache.shape[2] == runner.num_kvcache_blocks
    assert all(a.k_cache.data_ptr() == runner.kv_cache[0, i].data_ptr() for i, a in enumerate(runner.attn_layers))
    peaks = ["reset_peak_memory_stats", "synchronize", "max_memory_allocated"] * (not enforce_eager)
    assert memory.calls == [
        "synchronize",
        "empty_cache",
        "reset_peak_memory_stats",
        "memory_allocated",
        "synchronize",
        "max_memory_allocated",
        *peaks,
        "empty_cache",
        "mem_get_info",
    ]
    assert (runner.graph_runner is None) == enforce_eager and runner.compiled_forward is None
    if runner.graph_runner is not None:
        assert runner.graph_runner.batch_sizes == [1, 2, 4, 8, 16, 20]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    budget=st.integers(1, 300),
    max_model_len=st.integers(8, 128),
    max_num_seqs=st.integers(1, 40),
    spec_k=st.integers(0, 4),
    card_mb=st.integers(1, 8),
)
def test_profiled_shapes_and_blocks_follow_the_settings(
    tiny_llama_dir, budget, max_model_len, max_num_seqs, spec_k, card_mb
):
    """Whatever the token budget, length and batch limits: the profile's forwards are the plan's,
    and the cache is the budget's whole blocks, capped at what max_num_seqs full requests hold."""
    spec = {"method": "ngram", "num_speculative_tokens": spec_k} if spec_k else None
    cfg = _config(
        tiny_llama_dir,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        speculative_config=spec,
        enforce_eager=True,
    )
    total = card_mb * 1_000_000
    memory = StandInMemory(total=total, free=total - 200_000, allocated=50_000, peaks=[150_000])
    with recorded_forwards() as forwards:
        runner = ModelRunner(cfg, gpu=cpu_gpu_platform(memory))
    assert forwards == [budget, min(budget, max_num_seqs * (1 + spec_k))]
    kv_budget = kv_cache_budget(total, total - 200_000, 100_000, 0.9)
    cap = max_num_seqs * -(-max_model_len // BLOCK)
    assert runner.num_kvcache_blocks == min(kv_budget // _layout_bytes(runner), cap)


def test_a_card_with_no_room_for_a_block_is_refused_by_name(tiny_llama_dir):
    memory = StandInMemory(total=1_000_000, free=100_000, allocated=0, peaks=[10_000])
    with pytest.raises(ValueError, match="no room for a single KV block.*gpu_memory_utilization"):
        ModelRunner(_config(tiny_llama_dir, enforce_eager=True), gpu=cpu_gpu_platform(memory))


def test_profiling_is_refused_once_graphs_hold_the_cache(tiny_llama_dir):
    """A later profile would free the cache that the captured graphs write into."""
    memory = StandInMemory(total=2_000_000, free=1_500_000, allocated=0, peaks=[100_000, 100_000])
    runner = ModelRunner(_config(tiny_llama_dir), gpu=cpu_gpu_platform(memory))
    with pytest.raises(RuntimeError, match="before the decode graphs"):
        runner.profile_gpu_memory()
    cpu_runner = ModelRunner(_config(tiny_llama_dir, enforce_eager=True, num_kvcache_blocks=8))
    with pytest.raises(RuntimeError, match="GPUPlatform"):
        cpu_runner.profile_gpu_memory()


@pytest.mark.cuda
def test_a_measured_cache_leaves_room_for_the_largest_step(tiny_qwen3_dir):
    """On a real card: the sized cache plus the largest step stays inside the card's share."""
    utilization = 0.5
    llm = LLM(tiny_qwen3_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=utilization, max_model_len=256)
    runner = llm.llm_engine.executor.runner
    profile = runner.memory_profile
    assert profile["activation_peak"] > 0 and profile["kv_budget"] > 0
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert kv_bytes <= profile["kv_budget"]
    at_rest = torch.cuda.memory_allocated()  # weights, cache, graph pool
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=8, ignore_eos=True)
    llm.generate([[1, 2, 3] * 50] * 64, params, use_tqdm=False)
    # No step of the run goes further above the resting memory than the profile measured.
    assert torch.cuda.max_memory_allocated() - at_rest <= profile["activation_peak"] + 16 * 2**20
