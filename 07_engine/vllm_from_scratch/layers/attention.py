"""The attention layer: store this step's K/V in the paged cache (chapter 01's ``store_kvcache``),
then attend over it (chapter 02's ``paged_attention``, which picks flash-attn, Triton or torch by
device). The batch arrives as chapter 02's :class:`AttentionMetadata` record, which chapter 06's
batch builder made, passed down the model's forward: not through a global.

Under ``torch.compile`` or ``torch.export`` the two calls are one opaque operator,
:func:`unified_attention` (vLLM's name for the same thing): the kernels choose their path from the
batch's values, which no graph can hold, and the compiler fuses everything around it
(``compilation.py``). Where chapter 02's C++ kernels run, the operator is theirs,
``torch.ops.vllm_fs_cpu.store_and_attend``: the same two steps in C++, which a compiled graph
calls with no Python between its layers (a Python operator cost about 0.1 ms a call, a one-token
decode's attention 0.01).
"""

from __future__ import annotations

import torch
from torch import nn

from attention_backends import AttentionMetadata, paged_attention, select_backend
from store_kvcache import store_kvcache


def store_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Write ``k``/``v`` (``[T, kv_heads, head_dim]``) to their slots, then attend with ``q``."""
    store_kvcache(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
    return paged_attention(q, k_cache, v_cache, attn_metadata, scale, backend)


@torch.library.custom_op("vllm_fs::unified_attention", mutates_args=("kv_cache",))
def unified_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_index: int,
    batch: list[torch.Tensor],
    scale: float,
    backend: str,
) -> torch.Tensor:
    """:func:`store_and_attend` as one operator a compiled graph calls without looking inside.

    An operator takes tensors, not a record: ``batch`` is :meth:`AttentionMetadata.tensors`. It
    takes the whole KV cache (``[2, layers, ...]``) and this layer's index rather than the
    layer's two views of it: the graph then sees one input written in place, not two aliases of
    it per layer (which ``torch.export`` would copy back into the cache, and not all of them).
    No integer of the batch is an argument (it would be baked into the graph): the shape says
    what they would, since every request brings one token exactly when there are as many tokens
    as requests, and the token count bounds any request's share of them.
    """
    md = AttentionMetadata.from_tensors(batch, max_seqlen_q=q.shape[0])
    if q.shape[0] == md.block_tables.shape[0]:
        md.max_seqlen_q = 1  # one token per request: a decode
    return store_and_attend(q, k, v, kv_cache[0, layer_index], kv_cache[1, layer_index], md, scale, backend)


@unified_attention.register_fake
def _(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over ``k_cache``/``v_cache``.

    The model runner binds the KV cache tensor to every layer after allocating it
    (:meth:`bind_kv_cache`): ``k_cache`` and ``v_cache`` are this layer's slices of it
    (``[num_blocks, block_size, num_kv_heads, head_dim]`` each).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.backend = "auto"  # chapter 02's choice by device; tests may force "torch" or "triton"
        self.k_cache = self.v_cache = torch.tensor([])
        self.layer_index = 0

    def bind_kv_cache(self, kv_cache: torch.Tensor, layer_index: int) -> None:
        """Read and write layer ``layer_index`` of ``kv_cache`` (``[2, layers, blocks, ...]``)."""
        self.k_cache, self.v_cache, self.layer_index = kv_cache[0, layer_index], kv_cache[1, layer_index], layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() == 0:
            raise RuntimeError("the KV cache is not allocated: ModelRunner.allocate_kv_cache() binds it")
        if not torch.compiler.is_compiling():
            o = store_and_attend(q, k, v, self.k_cache, self.v_cache, md, self.scale, self.backend)
        elif md.kv_cache is None:
            raise RuntimeError("a compiled forward takes the whole KV cache in AttentionMetadata.kv_cache")
        elif select_backend(q, self.k_cache, self.backend) == "cpp":  # the same step in C++: no Python per layer
            batch = md.tensors()
            o = torch.ops.vllm_fs_cpu.store_and_attend(q, k, v, md.kv_cache, self.layer_index, *batch, self.scale)
        else:
            o = unified_attention(q, k, v, md.kv_cache, self.layer_index, md.tensors(), self.scale, self.backend)
        return o.reshape(-1, self.num_heads * self.head_dim)
