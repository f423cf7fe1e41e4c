"""Qwen2 (Qwen2, Qwen2.5): Llama's layout with a bias on the q, k and v projections, none on o."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_from_scratch.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig


class Qwen2Attention(LlamaAttention):
    """Llama's attention; Qwen2 checkpoints carry ``q_proj``/``k_proj``/``v_proj`` biases and no
    ``o_proj`` bias, whatever the config says."""

    @staticmethod
    def projection_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder plus LM head; every layer attends to its whole context (sliding windows,
    ``use_sliding_window=True``, are not supported and rejected)."""

    attention_cls = Qwen2Attention

    def __init__(
        self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1, tp_group: ProcessGroup | None = None
    ):
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=True) is not supported")
        super().__init__(config, tp_rank, tp_size, tp_group)
