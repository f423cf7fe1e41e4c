"""Every Triton kernel of the book compiles for an A100 (sm_80) and an H100 (sm_90), on any machine.

The chapters' Triton tests run the kernels in Triton's interpreter, which checks the arithmetic but
not what only the GPU compiler checks: ``tl.arange`` bounds that are powers of two, ``tl.dot``
operand shapes and dtypes, registers, shared memory. Here each kernel goes through the whole GPU
pipeline down to ``ptxas`` with :mod:`triton_aot_check`, launched by the book's own wrapper with
the shapes the engine gives it, so Triton specialises the real arguments:

* models: the default SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, vocabulary 49152) and
  Qwen3-0.6B (16, 8, 128, vocabulary 151936);
* dtypes bfloat16, float16 and float32; KV block sizes 16 and 256 (a compile-time constant of the
  attention kernels; ``store_kvcache`` sees only slot numbers, so it is compiled once per dtype).

Each compiled kernel must also keep its registers: no stack frame or local memory (what spills
become), no global scratch, shared memory within what one program may have on that GPU.

Without CUDA the pytest process runs with ``TRITON_INTERPRET=1`` (the root conftest), under which
no kernel can be compiled, so the compiling happens in a child process started without it: this
file run as a script, ``python tests/test_triton_compile.py 90``, one JSON line per case. Cold, the
two targets take about a minute on a busy 2-core CPU; Triton's on-disk cache brings reruns under
half of that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from triton_aot_check import MAX_SHARED_BYTES, ptxas_missing

pytestmark = pytest.mark.slow

CAPABILITIES = (80, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCK_SIZES = (16, 256)
NUM_SPECULATIVE_TOKENS = 4  # the documented example of speculative_config


@dataclass(frozen=True)
class ModelShape:
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


MODELS = {
    "smollm2-135m": ModelShape(heads=9, kv_heads=3, head_dim=64, vocab=49152),
    "qwen3-0.6b": ModelShape(heads=16, kv_heads=8, head_dim=128, vocab=151936),
}


@dataclass(frozen=True)
class Case:
    kernel: str  # "store_kvcache", "paged_decode", "paged_varlen" or "rejection_sample"
    model: str
    dtype: str
    block_size: int | None = None  # the attention kernels' compile-time KV block size

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.model}-{self.dtype}" + (f"-bs{self.block_size}" if self.block_size else "")


CASES = (
    [Case("store_kvcache", m, d) for m in MODELS for d in DTYPES]
    + [
        Case(k, m, d, bs)
        for k in ("paged_decode", "paged_varlen")
        for m in MODELS
        for d in DTYPES
        for bs in BLOCK_SIZES
    ]
    # The wrapper hands the kernel float32 probabilities whatever the model's dtype.
    + [Case("rejection_sample", m, "fp32") for m in MODELS]
)


# ---- The child: compile every case for one target and report ------------------------------------


def _launch(case: Case) -> tuple[ModuleType, tuple[str, ...], Callable[[], object]]:
    """(module, kernel names, the wrapper call) that launches ``case``'s kernel as the engine does."""
    shape, dtype = MODELS[case.model], DTYPES[case.dtype]
    hq, hkv, d, bs = shape.heads, shape.kv_heads, shape.head_dim, case.block_size or 16
    # A KV cache layer and two sequences of 5 and 9 tokens, each in a block of its own.
    k_cache = torch.zeros(2, bs, hkv, d, dtype=dtype)
    block_tables = torch.tensor([[0], [1]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 9], dtype=torch.int32)
    if case.kernel == "store_kvcache":
        import store_kvcache

        # K and V are column slices of the fused QKV projection's output, as in the engine.
        qkv = torch.zeros(4, (hq + 2 * hkv) * d, dtype=dtype)
        key = qkv[:, hq * d : (hq + hkv) * d].view(4, hkv, d)
        value = qkv[:, (hq + hkv) * d :].view(4, hkv, d)
        slots = torch.arange(4, dtype=torch.int32)
        return (
            store_kvcache,
            ("_store_kvcache_kernel",),
            lambda: store_kvcache.store_kvcache_triton(key, value, k_cache, k_cache, slots),
        )
    if case.kernel in ("paged_decode", "paged_varlen"):
        import paged_attention_triton as pat

        if case.kernel == "paged_decode":
            q = torch.zeros(2, hq, d, dtype=dtype)
            return (
                pat,
                ("_paged_decode_kernel",),
                lambda: pat.paged_attention_decode_triton(q, k_cache, k_cache, block_tables, seq_lens, d**-0.5),
            )
        q = torch.zeros(7, hq, d, dtype=dtype)
        cu_seqlens_q = torch.tensor([0, 3, 7], dtype=torch.int32)
        return (
            pat,
            ("_paged_varlen_kernel",),
            lambda: pat.paged_attention_varlen_triton(
                q, k_cache, k_cache, cu_seqlens_q, seq_lens, block_tables, d**-0.5
            ),
        )
    import rejection_sampler_triton

    B, K, V = 2, NUM_SPECULATIVE_TOKENS, shape.vocab
    draft_ids = torch.zeros(B, K, dtype=torch.long)
    draft_probs = torch.full((B, K, V), 1.0 / V)
    target_probs = torch.full((B, K + 1, V), 1.0 / V)
    return (
        rejection_sampler_triton,
        ("_rejection_sample_kernel",),
        lambda: rejection_sampler_triton.rejection_sample_triton(draft_ids, draft_probs, target_probs),
    )


def _compile_case(case: Case, capability: int) -> dict:
    from triton_aot_check import compile_only, gpu_target, resource_usage

    try:
        module, names, call = _launch(case)
        with compile_only(gpu_target(capability), module, *names) as compiled:
            call()
    except Exception as e:  # reported to the parent, which fails this case with it
        return {"case": case.id, "error": "".join(traceback.format_exception_only(e)).strip()[-4000:]}
    return {
        "case": case.id,
        "error": None,
        "kernels": [
            {
                "name": k.metadata.name,
                "shared": k.metadata.shared,
                "global_scratch": getattr(k.metadata, "global_scratch_size", 0) or 0,
                **resource_usage(k),
            }
            for k in compiled
        ],
    }


def _child_main(capability: int) -> None:
    for case in CASES:
        print(json.dumps(_compile_case(case, capability)), flush=True)


# ---- The parent: one child per target, one test per case -----------------------------------------

_reports: dict[int, dict[str, dict]] = {}


def _report(capability: int) -> dict[str, dict]:
    if capability not in _reports:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        child = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(capability)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if child.returncode:  # every case fails with it: one crash costs one child, not one per test
            died = f"the compiling child for sm_{capability} died:\n{child.stderr[-4000:]}"
            _reports[capability] = {case.id: {"case": case.id, "error": died} for case in CASES}
        else:
            # Only the report's lines: on a ptxas failure Triton also prints the PTX to stdout.
            lines = [line for line in child.stdout.splitlines() if line.startswith('{"case": ')]
            _reports[capability] = {r["case"]: r for r in map(json.loads, lines)}
    return _reports[capability]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c}")
def test_kernel_compiles_for_the_gpu_without_spills(capability, case):
    reason = ptxas_missing(capability)
    if reason:
        pytest.skip(reason)
    report = _report(capability)[case.id]
    assert report["error"] is None, f"{case.id} does not compile for sm_{capability}:\n{report['error']}"
    [kernel] = report["kernels"]  # one launch, one kernel
    assert kernel["STACK"] == 0 and kernel["LOCAL"] == 0, f"{kernel['name']} spills registers: {kernel}"
    assert kernel["global_scratch"] == 0, f"{kernel['name']} needs global scratch memory: {kernel}"
    assert kernel["shared"] <= MAX_SHARED_BYTES[capability], f"{kernel['name']} needs too much shared memory"


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
