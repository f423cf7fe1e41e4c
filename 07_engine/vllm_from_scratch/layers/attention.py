"""The attention layer: store this step's K/V in the paged cache (chapter 01's ``store_kvcache``),
then attend over it (chapter 02's ``paged_attention``, which picks flash-attn, Triton or torch by
device). The batch arrives as an explicit :class:`AttentionMetadata`, not through a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attention_backends import paged_attention
from store_kvcache import store_kvcache


@dataclass
class AttentionMetadata:
    """What attention needs to know about one batch of ``B`` requests and ``T`` new tokens.

    Attributes:
        slot_mapping: ``[T]`` cache slot of each new token (-1: do not store).
        cu_seqlens_q: ``[B+1]`` int32 offsets of each request's new tokens in the batch.
        seq_lens_k: ``[B]`` int32 tokens each request attends to (cached + new).
        block_tables: ``[B, max_blocks]`` int32 physical blocks of each request (padded).
        max_seqlen_q / max_seqlen_k: the largest of each (flash-attn wants them as ints).
        is_decode: every request brings exactly one token, so the decode kernel applies.
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over ``k_cache``/``v_cache``.

    The model runner points ``k_cache`` and ``v_cache`` at this layer's slice of the KV cache
    tensor (``[num_blocks, block_size, num_kv_heads, head_dim]`` each) after allocating it.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.backend = "auto"  # chapter 02's choice by device; tests may force "torch" or "triton"
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() == 0:
            raise RuntimeError("the KV cache is not allocated: ModelRunner.allocate_kv_cache() binds it")
        store_kvcache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        o = paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            md.cu_seqlens_q,
            md.seq_lens_k,
            md.block_tables,
            self.scale,
            max_seqlen_q=1 if md.is_decode else md.max_seqlen_q,
            backend=self.backend,
            max_seqlen_k=md.max_seqlen_k,
        )
        return o.reshape(-1, self.num_heads * self.head_dim)
