"""Qwen3: Llama's layout plus an RMSNorm over each head of q and of k before RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_from_scratch.layers.layernorm import RMSNorm
from vllm_from_scratch.layers.linear import TPArgs
from vllm_from_scratch.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from typing_extensions import Unpack


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, **tp: Unpack[TPArgs]):
        super().__init__(config, **tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).view(q.shape[0], -1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).view(k.shape[0], -1)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
