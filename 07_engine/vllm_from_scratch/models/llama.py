"""The Llama family (Llama 2/3, SmolLM2, Mistral-style GQA) in the engine's layers.

Parameter names follow the Hugging Face checkpoint except the fused ``qkv_proj`` and
``gate_up_proj``, which ``packed_modules_mapping`` tells the loader about.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attention_backends import AttentionMetadata
from vllm_from_scratch.layers.activation import SiluAndMul
from vllm_from_scratch.layers.attention import Attention
from vllm_from_scratch.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from vllm_from_scratch.layers.layernorm import RMSNorm
from vllm_from_scratch.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TPArgs
from vllm_from_scratch.layers.rotary_embedding import get_rope

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig
    from typing_extensions import Unpack


def rope_settings(config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from a transformers 5 ``rope_parameters`` or older fields."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or params
    return float(theta), (scaling if scaling.get("rope_type", "default") != "default" else None)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention: fused QKV, RoPE, paged attention, output projection."""

    def __init__(self, config: PretrainedConfig, **tp: Unpack[TPArgs]):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        qkv_bias, o_bias = self.projection_biases(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=qkv_bias, **tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=o_bias, **tp)
        theta, scaling = rope_settings(config)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    @staticmethod
    def projection_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """Whether ``qkv_proj`` and ``o_proj`` have a bias: Llama's ``attention_bias`` sets both."""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for models that normalise q and k per head before RoPE (Qwen3)."""
        return q, k

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: PretrainedConfig, **tp: Unpack[TPArgs]):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, **tp
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, **tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, attention_cls: type[LlamaAttention] = LlamaAttention, **tp: Unpack[TPArgs]
    ):
        super().__init__()
        self.self_attn = attention_cls(config, **tp)
        self.mlp = LlamaMLP(config, **tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm. A variant whose layers differ (MiniCPM) sets
    ``decoder_layer_cls``; one that scales the embeddings overrides ``embed_input_ids``."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self, config: PretrainedConfig, attention_cls: type[LlamaAttention] = LlamaAttention, **tp: Unpack[TPArgs]
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **tp)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, attention_cls, **tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden_states, residual = self.embed_input_ids(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama decoder plus LM head. ``forward`` returns hidden states; ``compute_logits`` is
    called only on the rows that sample (the last token of each request), not on every token.
    A variant whose layers differ only in attention (Qwen2, Qwen3) sets ``attention_cls``; one
    whose decoder differs otherwise (MiniCPM) sets ``model_cls``.
    """

    attention_cls: type[LlamaAttention] = LlamaAttention
    model_cls: type[LlamaModel] = LlamaModel
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1, tp_group: ProcessGroup | None = None
    ):
        super().__init__()
        tp = TPArgs(tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        self.config = config
        self.model = self.model_cls(config, self.attention_cls, **tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, **tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
