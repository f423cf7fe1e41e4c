"""``EngineConfig.compile``: the forward through inductor's compiled graphs (compilation.py).

The greedy-parity matrix of test_engine_parity.py (every engine feature, against transformers'
``generate``) runs again with ``compile=True``, on the tiny Llama and Qwen3 checkpoints, and both
graphs (small and large batches) must have served forwards. A second engine for the same
checkpoint loads the cached graphs without compiling. Each checkpoint compiles once per session
(about a minute per graph on a 2-core CPU), into a temporary cache directory.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import test_engine_parity
from test_engine_parity import BLOCK, FEATURES, GREEDY, hf_greedy, make_prompts
from vllm_from_scratch import LLM, compilation
from vllm_from_scratch.compilation import SMALL_BATCH_TOKENS, CompiledForward, compile_key
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.errors import ParameterError


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg_cache")


@pytest.fixture
def forward_sizes(monkeypatch, compile_cache):
    """Compiled forwards go to the session's cache directory; returns the token count of every
    forward that went through a compiled graph."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(compile_cache))
    sizes: list[int] = []
    run = CompiledForward.run

    def counted(self, input_ids, *args):
        sizes.append(input_ids.shape[0])
        return run(self, input_ids, *args)

    monkeypatch.setattr(CompiledForward, "run", counted)
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_compiled_greedy_matches_transformers(request, monkeypatch, forward_sizes, arch, feature):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    monkeypatch.setattr(test_engine_parity, "LLM", lambda *args, **kwargs: LLM(*args, compile=True, **kwargs))
    test_engine_parity.test_greedy_matches_transformers(model_dir, feature)
    assert min(forward_sizes) <= SMALL_BATCH_TOKENS < max(forward_sizes), "both graphs should have run"


@pytest.mark.slow
def test_second_engine_loads_the_cached_graphs(monkeypatch, forward_sizes, tiny_llama_dir):
    kwargs = dict(kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32", device="cpu", compile=True)
    LLM(tiny_llama_dir, **kwargs)  # compiles, or loads what an earlier test compiled

    def refuse(*args):
        raise AssertionError("the graphs should have come from the cache")

    monkeypatch.setattr(compilation, "_compile_graph", refuse)
    llm = LLM(tiny_llama_dir, **kwargs)
    prompts = make_prompts(4, (3, 11))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_llama_dir, tuple(p)) for p in prompts]
    assert forward_sizes


def test_compile_key_follows_threads_and_weights(tmp_path, tiny_qwen3_dir):
    model_dir = shutil.copytree(tiny_qwen3_dir, tmp_path / "model")  # a copy: the test touches its weights
    config = EngineConfig(str(model_dir), device="cpu", dtype="float32")
    key = compile_key(config)
    assert compile_key(config) == key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert compile_key(config) != key
    finally:
        torch.set_num_threads(threads)
    weights = next(model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert compile_key(config) != key


def test_compile_needs_one_cpu_rank(tiny_llama_dir):
    with pytest.raises(ParameterError, match="compile"):
        EngineConfig(tiny_llama_dir, device="cpu", tensor_parallel_size=2, compile=True)
