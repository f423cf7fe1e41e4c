"""MiniCPM (MiniCPM 1, 2 and 4): Llama's layers under µP's three scales, with LongRoPE.

MiniCPM was trained with µP (the maximal update parametrization): hyperparameters tuned on a
narrow proxy model carry over to the wide one because the width and depth enter the network as
fixed multipliers. Three of them remain at inference, each one number in config.json:

* the token embeddings are multiplied by ``scale_emb``;
* every residual branch (attention, MLP) is multiplied by ``scale_depth / sqrt(num_hidden_layers)``
  before it joins the residual stream;
* the final hidden state is divided by ``hidden_size / dim_model_base`` before the LM head.

Everything else is Llama's: the same projections, RMSNorm, SiLU MLP and tensor names, so the
model is the book's Llama with three overrides. MiniCPM4's long context is LongRoPE
(``rope_scaling`` of type ``longrope``, in ``layers/rotary_embedding.py``). The trainable sparse
attention of MiniCPM4-8B (InfLLM v2, ``sparse_config``) is not built and is refused by name.

transformers has no MiniCPM: the checkpoints ship their own Python (``auto_map``), which this
engine never runs. :class:`MiniCPMConfig` reads their config.json as a Llama config plus the
three scales, which it requires.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from transformers import LlamaConfig

from attention_backends import AttentionMetadata
from vllm_from_scratch.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig
    from typing_extensions import Unpack

    from vllm_from_scratch.layers.linear import TPArgs

MUP_SCALES = ("scale_emb", "scale_depth", "dim_model_base")


class MiniCPMConfig(LlamaConfig):
    """A MiniCPM config.json: Llama's keys, ``scale_emb``, ``scale_depth``, ``dim_model_base``,
    and ``rope_scaling``. Input and output embeddings are tied unless it says otherwise, as in
    the checkpoints' own configuration code."""

    model_type = "minicpm"
    tie_word_embeddings: bool = True


class MiniCPMDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with each branch's output scaled by ``scale_depth / sqrt(num_hidden_layers)``.

    The residual add is fused into the next RMSNorm (the post-attention norm, the next layer's
    input norm, the final norm), so a branch is scaled where it leaves its layer and the fused
    add then computes ``residual + scale * branch`` as µP wants.
    """

    def __init__(
        self, config: PretrainedConfig, attention_cls: type[LlamaAttention] = LlamaAttention, **tp: Unpack[TPArgs]
    ):
        super().__init__(config, attention_cls, **tp)
        self.branch_scale = config.scale_depth / math.sqrt(config.num_hidden_layers)

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
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata) * self.branch_scale
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.branch_scale, residual


class MiniCPMModel(LlamaModel):
    """Llama's decoder with MiniCPM's layers and the embeddings multiplied by ``scale_emb``."""

    decoder_layer_cls = MiniCPMDecoderLayer

    def __init__(
        self, config: PretrainedConfig, attention_cls: type[LlamaAttention] = LlamaAttention, **tp: Unpack[TPArgs]
    ):
        super().__init__(config, attention_cls, **tp)
        self.scale_emb = float(config.scale_emb)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.scale_emb


class MiniCPMForCausalLM(LlamaForCausalLM):
    """MiniCPM decoder plus LM head, which reads the hidden state divided by
    ``hidden_size / dim_model_base``. The division is in :meth:`compute_logits`, so it is paid
    only on the rows that sample; ``forward``'s hidden states are the final norm's, as Llama's are.
    """

    model_cls = MiniCPMModel

    def __init__(
        self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1, tp_group: ProcessGroup | None = None
    ):
        missing = [key for key in MUP_SCALES if getattr(config, key, None) is None]
        if missing:
            raise ValueError(f"a MiniCPM config.json must give the µP scales {list(MUP_SCALES)}; it lacks {missing}")
        if getattr(config, "sparse_config", None):
            raise ValueError(
                "sparse_config (MiniCPM4-8B's InfLLM v2 sparse attention) is not supported; delete the key from "
                "config.json to run the model with dense attention at every length, as vLLM does"
            )
        if getattr(config, "num_experts", 0):
            raise ValueError(f"num_experts={config.num_experts}: MiniCPM's mixture-of-experts MLP is not supported")
        super().__init__(config, tp_rank, tp_size, tp_group)
        self.scale_width = config.hidden_size / config.dim_model_base

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states / self.scale_width)
