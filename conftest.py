"""Book-wide pytest set-up, shared by every chapter's tests.

Triton kernels need a GPU; without one they run in Triton's interpreter, switched on by
``TRITON_INTERPRET=1`` before any kernel module is imported. The book's modules only read that
variable (no import changes the process's environment), so the test harness sets it here, once,
for every chapter's tests and the scripts they start; a value already set is kept. With CUDA it
stays unset, the kernels compile, and the same tests put a kernel's inputs on the GPU
(``triton_setup.KERNEL_DEVICE``: a compiled kernel cannot read CPU tensors).

A CPU engine compiles its forward by default (minutes per model, dtype and thread count), so
every engine a test builds passes ``enforce_eager=True`` (``--enforce-eager`` on a command line),
as vLLM's own tests do, except in ``test_compile.py``: an engine that starts compiling anywhere
else fails its test at once instead of costing minutes.

The whole suite runs in two xdist workers (the README's command), which share the machine's
cores. An OpenMP thread that spins at a barrier while the other worker computes takes that
worker's core, so each worker's threads, and the scripts its tests start, wait passively
(``OMP_WAIT_POLICY=PASSIVE``, set before torch loads OpenMP; a value already set is kept).
Chapters 03-06 on a 2-core VM: 143 s and 226 CPU-seconds spinning, 113 s and 175 passive.

The fixtures build tiny random Hugging Face checkpoints (Llama and Qwen3) in a temporary
directory, so chapters 05 and 07 can compare against transformers without any download.
"""

import os
import sys

import pytest

if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after OMP_WAIT_POLICY: OpenMP reads it once, when torch loads it)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _compiling_only_in_test_compile(request, monkeypatch):
    if request.module.__name__.endswith("test_compile") or "vllm_from_scratch" not in sys.modules:
        return
    from vllm_from_scratch import compilation

    def refuse(*args):
        # pytest.fail, not an Exception: the engine would catch that and run eagerly.
        pytest.fail("this test's engine started compiling its forward: pass enforce_eager=True")

    monkeypatch.setattr(compilation, "_compile_graphs", refuse)


def save_tiny_checkpoint(path, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Save a small random causal LM (``arch`` is 'llama', 'qwen2' or 'qwen3') with a GQA layout.

    Weights and biases are drawn wider than the default init (which zeroes biases) so greedy
    decoding is not a constant token and Qwen2's q/k/v biases matter.
    There is no tokenizer: prompts are token ids below ``vocab_size``.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ValueError(f"arch must be 'llama', 'qwen2' or 'qwen3', got {arch!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


# ---- Classroom exercises (exercises/README.md, docs/teaching.md) ---------------------------------
# `pytest 01_paged_kv/ --impl=student [--exercise 01.2]` (or VLLM_FS_IMPL=student) runs a
# chapter's own tests against the student's stubs in exercises/ instead of the reference code. The
# mechanism lives beside the stubs; it is loaded by path because exercises/ is not on sys.path.
def _load_exercise_plugin():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent / "exercises" / "exercise_plugin.py"
    spec = importlib.util.spec_from_file_location("vfs_exercise_plugin", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_exercise_plugin = _load_exercise_plugin()
pytest_addoption = _exercise_plugin.pytest_addoption
pytest_configure = _exercise_plugin.pytest_configure
