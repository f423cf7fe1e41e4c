"""Qwen3: Llama's layout plus an RMSNorm over each head of q and of k before RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_from_scratch.layers.layernorm import RMSNorm
from vllm_from_scratch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1, tp_group: ProcessGroup | None = None
    ):
        super().__init__(config, tp_rank, tp_size, tp_group)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).view(q.shape[0], -1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).view(k.shape[0], -1)
        return q, k


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
