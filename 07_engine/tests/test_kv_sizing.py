"""Sizing the KV cache on a GPU as nano-vllm does: measure the largest step, then give the cache
what is left of ``total × gpu_memory_utilization``.

The arithmetic and the profiling run are checked on the CPU with the CUDA memory probes faked;
the ``cuda``-marked test measures a real card.
"""

from __future__ import annotations

import pytest
import torch

from test_engine_parity import BLOCK
from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.compilation import CompiledForward
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


class FakeCudaMemory:
    """Stands in for the ``torch.cuda`` memory probes: 100 bytes allocated before the steps,
    a peak of 700 during them, a 1000-byte card with 600 free."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 100)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 700)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (600, 1000))


@pytest.mark.parametrize("spec_k", [0, 3])
def test_profiling_runs_the_largest_steps_and_sizes_from_the_probes(tiny_llama_dir, monkeypatch, spec_k):
    """The profile runs the whole token budget as prompts and the most sampling rows a step can
    have (times k + 1 with drafts) through the sampler, then frees its scratch cache."""
    spec = {"method": "ngram", "num_speculative_tokens": spec_k} if spec_k else None
    cfg = EngineConfig(
        tiny_llama_dir,
        device="cpu",
        dtype="float32",
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=8,
        max_model_len=64,
        max_num_batched_tokens=100,
        max_num_seqs=20,
        speculative_config=spec,
    )
    # Not eager, so that the profile sizes a CUDA graph pool; a CPU's compiled forward plays no part.
    monkeypatch.setattr(CompiledForward, "load_or_compile", lambda *args: None)
    runner = ModelRunner(cfg)
    FakeCudaMemory(monkeypatch)
    shapes, sampled_rows = [], []
    forward = runner._dummy_forward
    monkeypatch.setattr(runner, "_dummy_forward", lambda lens, *a, **k: shapes.append(lens) or forward(lens, *a, **k))
    sampler = runner.sampler
    monkeypatch.setattr(
        runner, "sampler", lambda logits, *a: sampled_rows.append(logits.shape[0]) or sampler(logits, *a)
    )
    profile = runner.profile_gpu_memory()
    assert shapes[0] == [64, 36]  # the 100-token budget as prompts of at most max_model_len
    assert sampled_rows == [min(100, 20 * (1 + spec_k))]
    assert shapes[2] == [1] * 20  # the largest decode graph's forward
    assert profile == dict(
        total=1000,
        free=600,
        weights_and_context=400,
        activation_peak=600,
        graph_pool=600,
        kv_budget=kv_cache_budget(1000, 600, 600, 0.9, 600),
    )
    assert not hasattr(runner, "kv_cache") and all(a.k_cache.numel() == 0 for a in runner.attn_layers)


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
