"""The model registry: ``architectures[0]`` of a checkpoint's config.json names the class.

Adding a model is one file in this directory plus one line here.
"""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("vllm_from_scratch.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("vllm_from_scratch.models.qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config):
    """The model class for a transformers config (``ValueError`` for an unknown architecture)."""
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"architectures {architectures} not supported; known: {supported_architectures()}")
