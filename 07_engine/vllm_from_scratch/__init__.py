"""vllm-from-scratch's engine: ``LLM(model=model_dir).generate(prompts, SamplingParams(...))``.

Built from the book's chapters by import: paged KV cache (01), paged attention (02), prefix
caching (03), the scheduler (04), speculative decoding (05), chunked prefill (06).

Names are resolved lazily (PEP 562), so ``from vllm_from_scratch import default_model_dir``
does not import torch models, the scheduler or the kernels.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "vllm_from_scratch.llm",
    "LLMEngine": "vllm_from_scratch.engine",
    "RequestOutput": "vllm_from_scratch.outputs",  # vLLM's result; the engine's step record is engine.RequestOutput
    "CompletionOutput": "vllm_from_scratch.outputs",
    "SamplingParams": "vllm_from_scratch.sampling_params",
    "BeamSearchParams": "vllm_from_scratch.sampling_params",
    "EngineArgs": "vllm_from_scratch.config",
    "StructuredOutputsParams": "vllm_from_scratch.sampling_params",
    "default_model_dir": "vllm_from_scratch.default_model",
    "register_model": "vllm_from_scratch.models",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vllm_from_scratch' has no attribute {name!r}")
