"""Greedy output of the engine equals transformers' greedy ``generate``, token for token.

The matrix: tiny random Llama, Qwen2 and Qwen3 checkpoints (GQA: 4 query heads, 2 KV heads), batched
prompts of different lengths crossing KV-block boundaries, with each engine feature switched on
by itself — prefix caching, chunked prefill, preemption — and all of them together. Float32, so
the comparison is exact. Every test ends with every KV block back (free, or cached with
reference count 0).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from triton_setup import INTERPRETED
from vllm_from_scratch import LLM, SamplingParams

MAX_TOKENS = 24
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def make_prompts(seed: int, lengths=(5, 8, 17, 33, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def _hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
    """transformers' greedy continuation of one prompt (stops at EOS like the engine)."""
    out = _hf_model(model_dir).generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def assert_parity(llm: LLM, model_dir: str, prompts: list[list[int]]) -> None:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(model_dir, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert_no_leak(llm)


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_invariants()
    assert engine.block_manager.all_blocks_free(), "a finished request kept KV blocks"


FEATURES = {
    "plain": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "prefix_caching": dict(enable_prefix_caching=True, enable_chunked_prefill=False),
    "chunked_prefill": dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=16),
    "preemption": dict(enable_prefix_caching=False, enable_chunked_prefill=False, num_kvcache_blocks=12),
    "all": dict(
        enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16, num_kvcache_blocks=12
    ),
}


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.mark.parametrize("feature", list(FEATURES))
def test_greedy_matches_transformers(model_dir, feature):
    kwargs = dict(kvcache_block_size=BLOCK, dtype="float32", device="cpu")
    kwargs.setdefault("num_kvcache_blocks", 256)
    kwargs.update(FEATURES[feature])
    llm = LLM(model_dir, **kwargs, enforce_eager=True)
    prompts = make_prompts(0)
    if feature in ("prefix_caching", "all"):
        # A shared 24-token system prefix (3 full blocks), asked twice: the second round hits.
        prefix = make_prompts(1, (24,))[0]
        prompts = [prefix + p for p in prompts[:3]]
        assert_parity(llm, model_dir, prompts)
        before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    assert_parity(llm, model_dir, prompts)
    stats = llm.llm_engine.get_stats()
    if feature in ("prefix_caching", "all"):
        assert stats["prefix_cache_hits"] > before
    if feature in ("preemption", "all"):
        assert stats["num_preemptions_total"] > 0, "the cache was meant to be too small for the batch"


def test_chunked_prefill_really_chunks(tiny_llama_dir):
    """With a 16-token budget the 40-token prompt needs three steps before its first token."""
    llm = LLM(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        enforce_eager=True,
    )
    engine = llm.llm_engine
    prompt = make_prompts(2, (40,))[0]
    engine.add_request(prompt, GREEDY)
    steps_without_output = 0
    while not (outs := engine.step()):
        steps_without_output += 1
    assert steps_without_output == 2
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == hf_greedy(tiny_llama_dir, tuple(prompt))
    assert_no_leak(llm)


def test_mixed_batches_with_decodes_and_late_arrivals(tiny_qwen3_dir):
    """Requests arriving while others decode share forwards (prefill chunks + decode tokens)."""
    llm = LLM(
        tiny_qwen3_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        max_num_batched_tokens=24,
        enforce_eager=True,
    )
    engine = llm.llm_engine
    prompts = make_prompts(3, (9, 30, 3, 21))
    done = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(p, GREEDY, request_id=str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
    for i, p in enumerate(prompts):
        assert done[i] == hf_greedy(tiny_qwen3_dir, tuple(p))
    assert_no_leak(llm)


# A CPU engine runs the Triton kernels only in the interpreter; where they are compiled (a CUDA
# machine), chapter 02's and the CUDA tests run them on the GPU.
TRITON_ON_CPU = pytest.param(
    "triton", marks=pytest.mark.skipif(not INTERPRETED, reason="Triton kernels are compiled here, not interpreted")
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [TRITON_ON_CPU, "torch"])
def test_greedy_matches_transformers_on_each_attention_backend(tiny_llama_dir, backend):
    """Chapter 02's other kernels inside the engine ("auto" on a CPU is the C++ decode kernel):
    the GPU's Triton kernels, run by Triton's interpreter, and the plain torch path.

    Prompts cross block boundaries and share a cached prefix, so both the varlen kernel (prefill,
    prefix hit) and the decode kernel run; every layer is forced onto ``backend``.
    """
    from vllm_from_scratch.layers.attention import Attention

    llm = LLM(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        device="cpu",
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        enforce_eager=True,
    )
    layers = [m for m in llm.llm_engine.executor.runner.model.modules() if isinstance(m, Attention)]
    assert layers
    for layer in layers:
        layer.backend = backend
    prefix = make_prompts(3, (16,))[0]
    prompts = [prefix + p for p in make_prompts(4, (3, 11))]
    for prompt in prompts:  # one after the other: the second one hits the first one's prefix
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
        assert out["token_ids"] == hf_greedy(tiny_llama_dir, tuple(prompt))[:6]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] >= 16
    assert_no_leak(llm)


def test_register_model_makes_a_new_architecture_loadable(tiny_llama_dir, tmp_path, monkeypatch):
    """A user's class, registered under a name transformers has never heard of, is what
    ``LLM`` builds for a checkpoint whose config.json names it, and it generates."""
    import json
    import shutil

    from vllm_from_scratch import models, register_model
    from vllm_from_scratch.models.llama import LlamaForCausalLM

    monkeypatch.setattr(models, "_MODELS", dict(models._MODELS))  # the registration ends with the test

    class MyLlamaForCausalLM(LlamaForCausalLM):
        pass

    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "my_llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MyLlamaForCausalLM"):
        LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=True)

    register_model("MyLlamaForCausalLM", MyLlamaForCausalLM)
    llm = LLM(
        str(model_dir),
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        device="cpu",
        enforce_eager=True,
    )
    assert type(llm.llm_engine.executor.runner.model) is MyLlamaForCausalLM
    prompts = make_prompts(5, (7, 19))
    assert_parity(llm, tiny_llama_dir, prompts)  # same weights as the tiny Llama: same tokens


def test_register_model_by_module_path_and_bad_arguments(monkeypatch):
    from transformers import LlamaConfig

    from vllm_from_scratch import models, register_model
    from vllm_from_scratch.models.qwen2 import Qwen2ForCausalLM

    monkeypatch.setattr(models, "_MODELS", dict(models._MODELS))
    register_model("LazyQwen2", "vllm_from_scratch.models.qwen2:Qwen2ForCausalLM")
    assert models.get_model_class(LlamaConfig(architectures=["LazyQwen2"])) is Qwen2ForCausalLM
    for bad_architecture in ("", None, 3):
        with pytest.raises(ValueError, match="architecture"):
            register_model(bad_architecture, Qwen2ForCausalLM)
    # an instance, a module without compute_logits, not a module, malformed strings, nothing
    for bad_cls in (torch.nn.Linear(2, 2), torch.nn.Linear, int, "no_colon_here", ":Cls", None):
        with pytest.raises(ValueError, match="cls"):
            register_model("Bad", bad_cls)
    assert "Bad" not in models.supported_architectures()
