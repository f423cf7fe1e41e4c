"""The model registry: ``architectures[0]`` of a checkpoint's config.json names the class.

The built-in families sit in ``_MODELS`` as ``"module:Class"`` strings, imported only when a
checkpoint asks for them; other code adds its own with :func:`register_model`, as vLLM's
``ModelRegistry.register_model`` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_MODELS: dict[str, str | type[nn.Module]] = {
    "LlamaForCausalLM": "vllm_from_scratch.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "vllm_from_scratch.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "vllm_from_scratch.models.qwen3:Qwen3ForCausalLM",
}


def register_model(architecture: str, cls: type[nn.Module] | str) -> None:
    """Make checkpoints whose config.json says ``"architectures": [architecture]`` load as ``cls``.

    ``cls`` is the class itself or a ``"package.module:ClassName"`` string, imported on first
    use. Registering a name again replaces the earlier class (a built-in one included).

    The class is what ``LLM(model_dir)`` builds and the runner calls, so it must provide:

    * ``__init__(config, tp_rank=0, tp_size=1, tp_group=None)``: ``config`` is the transformers
      config of the checkpoint; build the layers of rank ``tp_rank`` of ``tp_size`` (the
      ``layers/`` classes take these arguments) in the current default dtype and device;
    * ``forward(input_ids, positions, attn_metadata) -> hidden_states``: ``[T]`` token ids and
      positions, the :class:`~vllm_from_scratch.layers.attention.AttentionMetadata` that every
      ``Attention`` layer receives, and ``[T, hidden_size]`` out;
    * ``compute_logits(hidden_states) -> logits``: the LM head on the rows that sample (``None``
      on tensor-parallel ranks other than 0);
    * ``packed_modules_mapping``: checkpoint module name → ``(fused parameter's module, shard
      id)``, e.g. ``{"q_proj": ("qkv_proj", "q")}``; ``{}`` when nothing is fused. Parameter
      names must otherwise match the checkpoint's tensor names.

    Subclassing :class:`~vllm_from_scratch.models.llama.LlamaForCausalLM` gives all four.

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


def _resolve(entry: str | type[nn.Module]) -> type[nn.Module]:
    if isinstance(entry, type):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


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
