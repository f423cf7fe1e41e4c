"""Vocabulary-parallel embedding and LM head.

Rank ``r`` owns token ids ``[r*n, (r+1)*n)`` with ``n = ceil(vocab / tp_size)``; the last shard is
zero-padded when the vocabulary does not divide. The embedding looks up only its own ids, zeros
the rest and all-reduces; the LM head computes its slice of the logits and gathers them on rank 0,
the only rank that samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from block_manager import cdiv
from vllm_from_scratch.distributed import gather_to_first_rank
from vllm_from_scratch.layers.linear import TPArgs, _check_tp, set_weight_attrs
from vllm_from_scratch.layers.prepacked import PrepackableWeight

if TYPE_CHECKING:
    from typing_extensions import Unpack


class VocabParallelWeight(nn.Module):
    """A ``[vocab, dim]`` weight whose rows (token ids) are split across ranks: what the embedding
    and the LM head share. Their ``forward``s differ in what they return, so neither subclasses
    the other."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        _check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = cdiv(num_embeddings, tp_size)
        self.vocab_start_idx = self.num_embeddings_per_partition * tp_rank
        self.vocab_end_idx = min(self.vocab_start_idx + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = loaded_weight[self.vocab_start_idx : self.vocab_end_idx]
        param.data[: shard.size(0)].copy_(shard)
        param.data[shard.size(0) :].zero_()


class VocabParallelEmbedding(VocabParallelWeight):
    """``nn.Embedding`` whose rows (token ids) are split across ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = F.embedding(mask * (x - self.vocab_start_idx), self.weight)
        y = mask.unsqueeze(-1) * y
        dist.all_reduce(y, group=self.tp_group)
        return y


# Logits of a 16-bit head recomputed in float32 per row: the largest ones, where ties are decided.
REFINED_LOGITS = 8


class ParallelLMHead(PrepackableWeight, VocabParallelWeight):
    """The output projection to vocabulary logits: rank 0 returns the full logits, other ranks
    None (a gather, not an all-gather: only rank 0 samples).

    A 16-bit head rounds its output: logits of about 25 come in steps of 0.125, so two tokens whose
    float32 logits are 0.03 apart can come out equal, and argmax then takes the lower id (the
    default model's bfloat16 answer to "What is the capital of France?" turned on such a tie).
    An unsplit head therefore returns float32 logits: all of them as the engine's CPU GEMM sums
    them, unrounded, where it runs (:meth:`matmul_unrounded`); elsewhere each row's
    :data:`REFINED_LOGITS` largest recomputed in float32 from the same 16-bit inputs, as a GEMM
    accumulates them before rounding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, **tp: Unpack[TPArgs]):
        if bias:
            raise ValueError("bias=True is not supported by ParallelLMHead")
        super().__init__(num_embeddings, embedding_dim, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.tp_size == 1 and (unrounded := self.matmul_unrounded(x)) is not None:
            return unrounded[..., : self.num_embeddings]
        logits = gather_to_first_rank(self.matmul(x), self.tp_rank, self.tp_size, group=self.tp_group)
        if logits is None:
            return None
        logits = logits[..., : self.num_embeddings]
        if self.tp_size > 1 or logits.dtype == torch.float32:
            return logits
        top = logits.topk(min(REFINED_LOGITS, self.num_embeddings), dim=-1).indices
        exact = torch.einsum("...h,...kh->...k", x.float(), self.weight[top].float())
        return logits.float().scatter_(-1, top, exact)
