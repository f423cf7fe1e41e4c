"""The model registry: ``architectures[0]`` of a checkpoint's config.json names the class.

The built-in families sit in ``_MODELS`` as ``"module:Class"`` strings, imported only when a
checkpoint asks for them; other code adds its own with :func:`register_model`, as vLLM's
``ModelRegistry.register_model`` does. A family that transformers reads only by running the
checkpoint's own Python (MiniCPM) also has a config class in ``_CONFIGS``, keyed by the
``model_type`` of its config.json.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MODELS: dict[str, str | type[nn.Module]] = {
    "LlamaForCausalLM": "vllm_from_scratch.models.llama:LlamaForCausalLM",
    "MiniCPMForCausalLM": "vllm_from_scratch.models.minicpm:MiniCPMForCausalLM",
    "Qwen2ForCausalLM": "vllm_from_scratch.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "vllm_from_scratch.models.qwen3:Qwen3ForCausalLM",
}

# Config classes for the ``model_type`` of checkpoints that transformers cannot read without
# running the checkpoint's own Python (``auto_map``), which the engine never does.
_CONFIGS: dict[str, str] = {
    "minicpm": "vllm_from_scratch.models.minicpm:MiniCPMConfig",
}


def register_model(architecture: str, cls: type[nn.Module] | str) -> None:
    """Make checkpoints whose config.json says ``"architectures": [architecture]`` load as ``cls``.

    ``cls`` is the class or a ``"package.module:ClassName"`` string, imported on first use; a name
    registered again is replaced (a built-in one included). The class must provide (subclassing
    :class:`~vllm_from_scratch.models.llama.LlamaForCausalLM` gives all four):

    * ``__init__(config, tp_rank=0, tp_size=1, tp_group=None)``: rank ``tp_rank``'s layers for the
      checkpoint's transformers config, built in the current default dtype and device;
    * ``forward(input_ids, positions, attn_metadata)``: ``[T]`` ids and positions and an
      :class:`attention_backends.AttentionMetadata` in, ``[T, hidden_size]`` out;
    * ``compute_logits(hidden_states)``: the LM head on the rows that sample (``None`` on ranks
      other than 0);
    * ``packed_modules_mapping``: checkpoint module name → ``(fused module, shard id)``, such as
      ``{"q_proj": ("qkv_proj", "q")}``; other parameter names match the checkpoint's.

    Raises:
        ValueError: ``architecture`` is not a non-empty string, or ``cls`` is neither an
            ``nn.Module`` subclass with ``forward`` and ``compute_logits`` nor a
            ``"module:Class"`` string.
    """
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"architecture must be a non-empty string such as 'MyLlamaForCausalLM', got {architecture!r}")
    if isinstance(cls, str):
        module, _, name = cls.partition(":")
        if not (module and name):
            raise ValueError(f"cls must be a model class or a 'package.module:ClassName' string, got {cls!r}")
    elif not (
        isinstance(cls, type)
        and issubclass(cls, nn.Module)
        and cls.forward is not nn.Module.forward
        and callable(getattr(cls, "compute_logits", None))
    ):
        raise ValueError(f"cls must be an nn.Module subclass with forward() and compute_logits(), got {cls!r}")
    _MODELS[architecture] = cls


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _resolve(entry: str | type) -> type:
    if isinstance(entry, type):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def get_config_class(model_type: str | None) -> type[PretrainedConfig] | None:
    """The engine's own config class for ``model_type``, or None where transformers reads it."""
    entry = _CONFIGS.get(model_type or "")
    return None if entry is None else _resolve(entry)


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The model class for a transformers config (``ValueError`` for an unknown architecture)."""
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in _MODELS:
            return _resolve(_MODELS[arch])
    raise ValueError(
        f"architectures {architectures} not supported; known: {supported_architectures()} "
        "(vllm_from_scratch.register_model adds one)"
    )
