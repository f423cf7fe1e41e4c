"""CUDA graphs for decode: launch a whole forward with one call instead of hundreds.

nano-vllm's scheme (07_engine/topics/cuda_graphs.md): decode forwards captured at
:func:`capture_batch_sizes`; a batch of ``n`` replays the smallest captured size ``>= n`` from
static buffers, its extra rows padded with slot -1 (store nothing) and context length 1 (not 0:
no kernel meets an empty softmax). The LM head stays outside the graph. The captured forward must
never sync with the host (no ``.item()``, ``.tolist()`` or data-dependent shapes);
``max_seqlen_k`` is frozen at ``max_model_len``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from attention_backends import AttentionMetadata
from block_manager import cdiv

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

MAX_CAPTURE_SIZE = 512


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, 16, 32, ... up to ``min(max_num_seqs, 512)``,
    always including that maximum itself."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    max_bs = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if s < max_bs]
    return sizes + [max_bs]


class _EagerReplay:
    """Stands in for ``torch.cuda.CUDAGraph`` where there is no GPU: ``replay()`` runs the same
    closure on the same static buffers, eagerly. Through it the CPU tests run everything around
    the graph (size choice, copy-in to the static buffers, padding rows, slot -1, the capture
    writing nothing), all but the capture itself."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def replay(self) -> None:
        self._fn()


class CUDAGraphRunner:
    """Decode forwards replayed from graphs captured at :func:`capture_batch_sizes`.

    Args:
        model: ``model(input_ids, positions, attn_metadata) -> hidden_states``, its KV cache
            bound before :meth:`capture`.
        max_num_seqs: the scheduler's limit; sizes above ``min(max_num_seqs, 512)`` run eagerly.
        max_model_len: bounds the block-table width and the frozen ``max_seqlen_k``.
        hidden_size / dtype / device: of the hidden states; every buffer is on ``device``.
        use_cuda_graph: False captures :class:`_EagerReplay` stand-ins instead of CUDA graphs
            (``GPUPlatform(cuda_graphs=False)`` in ``model_runner.py``: how CI runs this on a CPU).
    """

    def __init__(
        self,
        model: Callable,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        use_cuda_graph: bool = True,
    ):
        device = torch.device(device)
        if use_cuda_graph and device.type != "cuda":
            raise ValueError(f"device must be a CUDA device to capture CUDA graphs, got {device}")
        self.model = model
        self.device = device
        self.use_cuda_graph = use_cuda_graph
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.max_bs = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        self.max_num_blocks = cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=torch.long, device=device)
        self.seq_lens_k = torch.ones(self.max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_bs, self.max_num_blocks, dtype=torch.int32, device=device)
        # One decode token per request: query offsets are simply 0, 1, 2, ...
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        self.hidden_states = torch.zeros(self.max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | _EagerReplay] = {}
        self.graph_pool: _POOL_HANDLE | None = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens_k=self.seq_lens_k[:bs],
            block_tables=self.block_tables[:bs],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
        )

    def _forward_into_buffers(self, bs: int) -> None:
        self.hidden_states[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self._metadata(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, in one shared memory pool; the buffers hold
        padding rows only (slot -1), so capturing writes nothing to the KV cache."""
        for bs in reversed(self.batch_sizes):
            # A warm-up run first: lazy initialisations (cuBLAS handles, NCCL communicators,
            # Triton autotuning) must not happen inside the capture. The stand-in runs it too, so
            # that "capturing writes nothing" is checked on a CPU as well.
            self._forward_into_buffers(bs)
            if not self.use_cuda_graph:
                self.graphs[bs] = _EagerReplay(functools.partial(self._forward_into_buffers, bs))
                continue
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._forward_into_buffers(bs)
            if self.graph_pool is None:
                self.graph_pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize(self.device)

    def padded_batch_size(self, n: int) -> int:
        """The captured size a batch of ``n`` replays (the smallest one ``>= n``)."""
        if not 1 <= n <= self.max_bs:
            raise ValueError(f"n must be in [1, {self.max_bs}], got {n}")
        return next(bs for bs in self.batch_sizes if bs >= n)

    def can_run(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata) -> bool:
        """A pure-decode batch no larger than the largest graph, with block tables that fit."""
        return (
            bool(self.graphs)
            and attn_metadata.is_decode
            and 1 <= input_ids.numel() <= self.max_bs
            and attn_metadata.block_tables.size(1) <= self.max_num_blocks
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the decode forward of ``n`` requests; returns their ``[n, hidden]`` states.

        The returned tensor is a view of the graph's output buffer, valid until the next replay.
        """
        n = input_ids.numel()
        bs = self.padded_batch_size(n)
        width = attn_metadata.block_tables.size(1)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:bs].fill_(-1)
        self.slot_mapping[:n] = attn_metadata.slot_mapping
        self.seq_lens_k[:bs].fill_(1)
        self.seq_lens_k[:n] = attn_metadata.seq_lens_k
        self.block_tables[:n, :width] = attn_metadata.block_tables
        # Clear what an earlier, wider batch left past this width: the context lengths mask those
        # columns anyway, but this way a replay depends on this batch alone.
        self.block_tables[:n, width:] = 0
        self.graphs[bs].replay()
        return self.hidden_states[:n]
