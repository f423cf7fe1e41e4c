"""The forward through inductor's compiled graphs (compilation.py), a CPU engine's default.

The greedy-parity matrix of test_engine_parity.py (every engine feature, against transformers'
``generate``; eager there, as in every other test) runs again with ``enforce_eager=False``, on
the tiny Llama and Qwen3 checkpoints, and the small and large batches' forward graphs must have
served forwards; the graph of the LM head of a few rows, where there is one, equals the model's
own. A second engine for the same checkpoint loads the cached
graphs without compiling. Each checkpoint compiles once per session (about a minute per graph
on a 2-core CPU), into a temporary cache directory.

In bfloat16 no engine is token-identical to transformers, eager or compiled: logits of about 20
carry steps of 0.125, so where the two best tokens are that close, summation order picks one.
There the check is vLLM's own (``check_logprobs_close``): the continuations may part only where
each side's token is among the other's top five, on the default model, compiled as ``setup.sh``
leaves it and eager.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import test_engine_parity
from paged_attention_cpu import cpu_kernel_available
from test_engine_parity import BLOCK, FEATURES, GREEDY, hf_greedy, make_prompts
from vllm_from_scratch import LLM, SamplingParams, compilation, default_model_dir
from vllm_from_scratch.compilation import SMALL_BATCH_TOKENS, CompiledForward, compile_key
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.layers import bf16_gemm, f32_gemm
from vllm_from_scratch.layers.prepacked import PrepackableWeight
from vllm_from_scratch.loader import resolve_dtype


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg_cache")


@pytest.fixture
def forward_sizes(monkeypatch, compile_cache):
    """Compiled forwards go to the session's cache directory; returns the token count of every
    forward that went through a compiled graph."""
    # Not XDG_CACHE_HOME: chapter 02's kernel is cached under it too, and a fresh one rebuilds it.
    monkeypatch.setattr(compilation, "cache_root", lambda: compile_cache)
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
    monkeypatch.setattr(
        test_engine_parity, "LLM", lambda *args, **kwargs: LLM(*args, **{**kwargs, "enforce_eager": False})
    )
    test_engine_parity.test_greedy_matches_transformers(model_dir, feature)
    served = {compilation.graph_for(tokens) for tokens in forward_sizes}
    assert "small" in served and len(served) > 1, f"small and larger batches should have run: {served}"


@pytest.mark.slow
def test_second_engine_loads_the_cached_graphs(monkeypatch, tmp_path, forward_sizes, tiny_llama_dir):
    kwargs = dict(kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32", device="cpu")
    LLM(tiny_llama_dir, **kwargs)  # compiles, or loads what an earlier test compiled

    def refuse(*args):
        raise AssertionError("the graphs should have come from the cache")

    monkeypatch.setattr(compilation, "_compile_graph", refuse)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    llm = LLM(tiny_llama_dir, **kwargs)
    # Loading unzips each package's library under $TMPDIR: nothing of it may stay on disk.
    assert list(tmp_path.iterdir()) == []
    assert os.environ["TMPDIR"] == str(tmp_path)
    prompts = make_prompts(4, (3, 11))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_llama_dir, tuple(p)) for p in prompts]
    assert forward_sizes


@pytest.mark.slow
@pytest.mark.parametrize("engine_gemm", [True, False])
def test_the_lm_head_of_a_few_rows_runs_compiled_where_it_has_a_graph(
    monkeypatch, forward_sizes, tiny_llama_dir, engine_gemm
):
    """Where the engine's float32 GEMM runs there is no LM-head graph, and every row count takes
    the model's own head. Without it (here also forced off) the small batches and the LM head of
    a few rows run inductor's template graphs: transformers' greedy tokens, the model's logits."""
    if not engine_gemm:
        monkeypatch.setattr(f32_gemm, "gemm_available", lambda: False)
    llm = LLM(tiny_llama_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32", device="cpu")
    runner = llm.llm_engine.executor.runner
    hidden = torch.randn(SMALL_BATCH_TOKENS + 1, runner.config.hf_config.hidden_size)
    has_graph = "logits" in compilation.graph_names(runner.config)
    assert has_graph != (engine_gemm and f32_gemm.gemm_available())
    prompts = make_prompts(4, (3, 11))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_llama_dir, tuple(p)) for p in prompts]
    assert "small" in {compilation.graph_for(tokens) for tokens in forward_sizes}
    with torch.inference_mode():
        for rows in (1, SMALL_BATCH_TOKENS):
            if not has_graph:
                assert runner.compiled_forward.compute_logits(hidden[:rows]) is None
                continue
            compiled = runner.compiled_forward.compute_logits(hidden[:rows])
            torch.testing.assert_close(compiled, runner.model.compute_logits(hidden[:rows]), atol=1e-4, rtol=1e-4)
        assert runner.compiled_forward.compute_logits(hidden) is None  # more rows: the model's own head
        assert runner.compiled_forward.compute_logits(hidden[:0]) is None


def test_a_compiled_forward_runs_without_the_gil_and_as_torchs_loader_does(monkeypatch, forward_sizes, tiny_llama_dir):
    """The server's event loop must run while the engine's thread is inside a forward. With a
    switch interval of minutes, another thread gets the GIL only where the running one lets it
    go: in 20 forwards of a 400-token prompt a counting thread got 16-20 turns with torch's loader
    (at their edges) and 313-321 with the engine's (Zen 5 VM; a 37-token prompt's forwards were
    too short there: 9-20 against 39-61). Both loaders give the same hidden states."""
    import hashlib
    import sys
    import threading

    from vllm_from_scratch import graph_package

    captured = []
    counted = CompiledForward.run
    monkeypatch.setattr(
        CompiledForward, "run", lambda self, *args: captured.append((self, args)) or counted(self, *args)
    )
    llm = LLM(tiny_llama_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32", device="cpu")
    # A prompt of 400 tokens: forwards long enough that the counter gets turns inside them on any CPU.
    llm.generate([{"prompt_token_ids": list(range(3, 403))}], SamplingParams(max_tokens=1, temperature=0.0))
    compiled, (input_ids, positions, md, kv_cache) = captured[-1]
    assert graph_package.releases_the_gil()
    assert all(isinstance(g, graph_package.GraphPackage) for g in compiled.graphs.values())
    name = compilation.graph_for(input_ids.shape[0])
    config = llm.llm_engine.executor.runner.config
    directory = compilation.cache_root() / hashlib.sha256(compile_key(config).encode()).hexdigest()[:16]
    # Where the loader cannot be built, graph_package.load falls back to torch's.
    monkeypatch.setattr(graph_package, "releases_the_gil", lambda: False)
    theirs = compilation._load_package(directory / f"{name}.pt2")  # unzipped into a directory it removes
    assert not isinstance(theirs, graph_package.GraphPackage)
    inputs = (input_ids, positions, *md.tensors(), kv_cache)
    assert torch.equal(compiled.graphs[name](*inputs), theirs(*inputs))

    turns, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            turns[0] += 1
            time.sleep(0)  # hands the GIL back at once, as an idle event loop does

    def turns_during(graph) -> int:
        before = turns[0]
        for _ in range(20):
            graph(*inputs)
        return turns[0] - before

    previous = sys.getswitchinterval()
    counter = threading.Thread(target=count, daemon=True)
    sys.setswitchinterval(300.0)
    try:
        counter.start()
        time.sleep(0.05)  # the counter starts, then waits for the GIL
        held, released = turns_during(theirs), turns_during(compiled.graphs[name])
    finally:
        stop.set()
        sys.setswitchinterval(previous)
        counter.join()
    assert released > 4 * held + 20, (held, released)


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


def test_the_graph_calls_chapter_02s_cpp_operator_for_attention(tiny_llama_dir):
    """Every layer's attention in the exported forward is one call of the C++ store_and_attend
    (no Python between the layers) where chapter 02's kernels load, else the Python operator."""
    llm = LLM(tiny_llama_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32", enforce_eager=True)
    runner = llm.llm_engine.executor.runner
    example = compilation._example_inputs(8, runner.kv_cache, BLOCK)
    with torch.inference_mode():
        program = torch.export.export(compilation._ForwardWithCache(runner.model), example, strict=False)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    expected = "vllm_fs_cpu.store_and_attend" if cpu_kernel_available() else "vllm_fs.unified_attention"
    assert sum(expected in t for t in targets) == len(runner.attn_layers), targets


GEMMS = {"float32": (f32_gemm, "vllm_fs_f32_gemm.linear"), "bfloat16": (bf16_gemm, "vllm_fs_gemm.linear")}


@pytest.mark.parametrize("dtype", list(GEMMS))
def test_where_the_engines_gemm_runs_every_graph_calls_it(tiny_llama_dir, dtype):
    """Where the engine has a GEMM for the model's dtype, every linear of both forward graphs is
    one call of it, there is no LM-head graph and no graph keeps inductor's template."""
    gemm, op = GEMMS[dtype]
    if not gemm.gemm_available():
        pytest.skip(f"this CPU runs no engine GEMM for {dtype}")
    config = EngineConfig(tiny_llama_dir, device="cpu", dtype=dtype)
    assert compilation.graph_names(config) == ["small", "large"]
    assert compilation.template_graphs(config) == frozenset()
    llm = LLM(tiny_llama_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype=dtype, enforce_eager=True)
    runner = llm.llm_engine.executor.runner
    layers = [m for m in runner.model.modules() if isinstance(m, PrepackableWeight)]
    assert all(m.gemm_weight is not None and m.gemm_weight.dtype == getattr(torch, dtype) for m in layers)

    def gemm_calls(tokens: int) -> int:
        example = compilation._example_inputs(tokens, runner.kv_cache, BLOCK)
        with torch.inference_mode():
            program = torch.export.export(compilation._ForwardWithCache(runner.model), example, strict=False)
        return sum(op in str(node.target) for node in program.graph.nodes)

    layer_linears = 4 * runner.model.config.num_hidden_layers  # QKV, O, gate-up, down
    assert (
        compilation.graph_for(SMALL_BATCH_TOKENS) == "small"
        and compilation.graph_for(SMALL_BATCH_TOKENS + 1) == "large"
    )
    assert gemm_calls(SMALL_BATCH_TOKENS) == layer_linears
    assert gemm_calls(SMALL_BATCH_TOKENS + 1) == layer_linears


class _OneWeight(PrepackableWeight, torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype), requires_grad=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("engine_gemms", [False, True])
def test_the_template_graphs_are_where_the_layers_hold_no_engine_gemm_weight(
    tiny_llama_dir, monkeypatch, dtype, engine_gemms
):
    """Every dtype, with the engine's GEMMs available or not (forced either way): the small and
    LM-head graphs take inductor's template exactly where a loaded layer's weight is not packed
    for the engine's GEMM, the layers' own rule (``PrepackableWeight.prepack``)."""
    for gemm, _ in GEMMS.values():
        monkeypatch.setattr(gemm, "gemm_available", lambda: engine_gemms)
    monkeypatch.setattr(bf16_gemm, "pack", lambda weight: weight.new_zeros(1))
    monkeypatch.setattr(f32_gemm, "pack", lambda weight: weight.new_zeros(1))
    layer = _OneWeight(getattr(torch, dtype))
    layer.prepack(float32_copy=False)
    packed_for_the_engine = layer.gemm_weight is not None
    config = EngineConfig(tiny_llama_dir, device="cpu", dtype=dtype)
    templates = compilation.template_graphs(config)
    assert templates == (frozenset() if packed_for_the_engine else compilation.TEMPLATE_GRAPHS)
    assert ("logits" in compilation.graph_names(config)) == (not packed_for_the_engine)
    assert packed_for_the_engine == (engine_gemms and dtype != "float16")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(tokens=st.integers(-2, 4096))
def test_a_batch_runs_the_first_graph_whose_range_holds_its_tokens(tokens):
    """Small up to SMALL_BATCH_TOKENS, large above; a batch of no tokens has no graph."""
    ran: list[str] = []
    graphs = {name: (lambda *args, name=name: ran.append(name)) for name in compilation.GRAPHS}

    class Metadata:
        def tensors(self) -> tuple[torch.Tensor, ...]:
            return ()

    forward = CompiledForward(graphs)
    if tokens < 1:
        with pytest.raises(ValueError, match="tokens"):
            compilation.graph_for(tokens)
        return
    forward.run(torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens), Metadata(), torch.zeros(1))
    assert ran == (["small"] if tokens <= SMALL_BATCH_TOKENS else ["large"])
    assert compilation.graph_for(tokens) == ran[0]


def test_a_cpu_compiles_unless_eager_is_enforced_or_the_model_is_split(tiny_llama_dir):
    assert EngineConfig(tiny_llama_dir, device="cpu").compiles
    assert not EngineConfig(tiny_llama_dir, device="cpu", enforce_eager=True).compiles
    assert not EngineConfig(tiny_llama_dir, device="cpu", tensor_parallel_size=2).compiles


def test_a_compiler_failure_leaves_the_eager_forward(monkeypatch, compile_cache, tiny_llama_dir, caplog):
    monkeypatch.setattr(compilation, "cache_root", lambda: compile_cache / "failing")

    def fail(*args):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(compilation, "_compile_graph", fail)
    llm = LLM(tiny_llama_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32", device="cpu")
    assert llm.llm_engine.executor.runner.compiled_forward is None
    assert "no C++ compiler here" in caplog.text and "eagerly" in caplog.text
    prompts = make_prompts(5, (3, 11))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_llama_dir, tuple(p)) for p in prompts]


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 + 30?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is.",
    "List the planets of the solar system.",
    "How do I boil an egg?",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def chat_prompts() -> list[list[int]]:
    tok = LLM(default_model_dir(), num_kvcache_blocks=16, warm_up=False, enforce_eager=True).tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return [tok.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def hf_bfloat16_greedy(chat_prompts) -> list[tuple[list[int], list[list[int]]]]:
    """Transformers' bf16 greedy continuation of each prompt and its top five at every step."""
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.bfloat16).eval()
    refs = []
    for prompt in chat_prompts:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=64,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        refs.append((out.sequences[0, len(prompt) :].tolist(), [s[0].topk(5).indices.tolist() for s in out.scores]))
    return refs


@pytest.mark.slow
@pytest.mark.skipif(
    resolve_dtype("auto", "cpu") != torch.bfloat16,
    reason="this CPU has no bfloat16 in hardware (the engine's auto dtype is float32)",
)
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["compiled", "eager"])
def test_bfloat16_greedy_parts_from_transformers_only_at_near_ties(chat_prompts, hf_bfloat16_greedy, enforce_eager):
    llm = LLM(
        default_model_dir(), dtype="bfloat16", num_kvcache_blocks=256, max_model_len=1024, enforce_eager=enforce_eager
    )
    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    parted = 0
    for question, out, (theirs, their_top5) in zip(QUESTIONS, outs, hf_bfloat16_greedy):
        ours = out.outputs[0].token_ids
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if at is None:
            assert len(ours) == len(theirs)
            continue
        parted += 1
        assert ours[at] in their_top5[at] and theirs[at] in out.outputs[0].logprobs[at], (question, at)
    assert parted < len(outs), "no prompt followed transformers to its end"
