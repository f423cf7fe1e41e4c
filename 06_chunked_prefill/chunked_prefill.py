"""Chunked prefill: a long prompt goes through in pieces, and decodes ride in every step.

Chapter 04's scheduler runs a prompt whole: a 4,000-token prompt makes one 4,000-token step,
and every request that is decoding waits for it (its next token is late by a whole prefill).
With chunking, the scheduler gives each request ``min(tokens left, token budget left,
long_prefill_token_threshold)`` tokens; a prompt that does not fit finishes in later steps, and
only the step that reaches its end samples a token. Because ``num_computed_tokens`` already
says where each request stands, this is one overridden method of chapter 04's scheduler, plus
an order: decoding requests are visited first, so a long prefill can never take their budget::

    budget 8    step 1            step 2            step 3
    decode A    A                 A                 A
    decode B    B                 B                 B
    prompt P    P[0:6]   (no tok) P[6:12]  (no tok) P[12:14] -> samples its first token

:class:`SchedulerInfo` is seed 003's description of such a mixed batch (``merge_prompt``,
``chunk_len``, ``last_pos`` ...), built from a :class:`scheduler.SchedulerOutput`;
:func:`build_batch_inputs` turns a step into the flat tensors one forward pass needs
(``input_ids``, ``positions``, ``cu_seqlens_q``, ``seq_lens_k``, ``slot_mapping``,
``block_tables``, ``logits_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from block_manager import BlockManager
from kv_cache import build_slot_mapping
from scheduler import Request, Scheduler, SchedulerOutput


class ChunkedPrefillScheduler(Scheduler):
    """Chapter 04's :class:`Scheduler` with prompts split into chunks (vLLM V1's default).

    Args: those of :class:`Scheduler`, plus

        long_prefill_token_threshold: most tokens one request's prefill may take in a step
            (``None`` or 0: only the budget limits it). A smaller value leaves room for more
            requests per step and bounds how much a single prompt slows a step down.

    Prompts longer than ``max_num_batched_tokens`` are fine here; a request only has to fit
    in the KV cache on its own.
    """

    chunked_prefill = True

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, num_gpu_blocks: int,
                 policy: str = "fcfs", block_size: int = 16, block_manager: BlockManager | None = None,
                 long_prefill_token_threshold: int | None = None):
        super().__init__(max_num_seqs, max_num_batched_tokens, num_gpu_blocks, policy, block_size, block_manager)
        if long_prefill_token_threshold is not None and long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}")
        self.long_prefill_token_threshold = long_prefill_token_threshold or None

    def check_schedulable(self, request: Request) -> None:
        self._check_fits_in_cache(request)  # any prompt length: it goes through in chunks

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        num_new = req.num_tokens - num_computed
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        num_new = min(num_new, budget)
        return num_new + self._num_spec_tokens(req, num_computed, num_new, budget - num_new)

    def _running_order(self) -> list[Request]:
        # Decodes first (seed 003's order): a request that is still prefilling may be earlier in
        # the running list, and would otherwise take the whole budget for its next chunk.
        decoding = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        return decoding + prefilling


@dataclass
class SchedulerInfo:
    """Seed 003's batch description: every scheduled request's slice of one merged input.

    Row ``i`` is request ``ids[i]``; its tokens are ``merge_prompt[chunk_idx[i] :
    chunk_idx[i] + chunk_len[i]]`` at positions ``kv_len[i] ...``, attending to ``kv_len[i] +
    chunk_len[i]`` keys held in ``kv_page_len[i]`` blocks. ``last_pos[i]`` is the index *inside
    the chunk* whose logits sample the next token, ``-1`` when the chunk stops short of the end
    of the prompt (those logits would predict from a partial prompt, and are dropped). Rows
    come in the scheduler's batch order: with :class:`ChunkedPrefillScheduler`, decodes first.

    Differences from the seed: the seed's ``kv_len`` is a length kept by the engine, here it is
    the request's ``num_computed_tokens`` (prefix-cache hits included), and a decode row may
    carry speculative draft tokens (``num_spec``), whose every position is scored.
    """

    ids: list[str] = field(default_factory=list)
    chunk_prompts: list[list[int]] = field(default_factory=list)
    chunk_idx: list[int] = field(default_factory=list)
    chunk_len: list[int] = field(default_factory=list)
    merge_prompt: list[int] = field(default_factory=list)
    kv_len: list[int] = field(default_factory=list)
    kv_page_len: list[int] = field(default_factory=list)
    is_decoding: list[bool] = field(default_factory=list)
    last_pos: list[int] = field(default_factory=list)
    num_spec: list[int] = field(default_factory=list)
    decoding_batch: int = 0
    prefill_batch: int = 0

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> "SchedulerInfo":
        """Describe ``out`` (call it between ``schedule()`` and ``update_from_output()``)."""
        info = cls()
        for req in out.scheduled_requests:
            chunk = out.input_token_ids(req)
            decoding = out.is_decoding(req)
            info.ids.append(req.request_id)
            info.chunk_prompts.append(chunk)
            info.chunk_idx.append(len(info.merge_prompt))
            info.chunk_len.append(len(chunk))
            info.merge_prompt.extend(chunk)
            info.kv_len.append(out.num_computed_tokens[req.request_id])
            info.kv_page_len.append(len(req.block_table))
            info.is_decoding.append(decoding)
            info.last_pos.append(len(chunk) - 1 if out.produces_token(req) else -1)
            info.num_spec.append(len(out.scheduled_spec_decode_tokens.get(req.request_id, ())))
            info.decoding_batch += decoding
            info.prefill_batch += not decoding
        return info

    @property
    def logits_indices(self) -> list[int]:
        """Rows of the merged input whose logits sample: each draft position, then the last."""
        return [idx + last - k + j for idx, last, k in zip(self.chunk_idx, self.last_pos, self.num_spec)
                if last >= 0 for j in range(k + 1)]


@dataclass
class BatchInputs:
    """The flat tensors of one forward over a mixed batch (``T`` tokens, ``B`` requests)."""

    input_ids: torch.Tensor  # [T] merge_prompt
    positions: torch.Tensor  # [T] position of each token in its own request
    cu_seqlens_q: torch.Tensor  # [B + 1] int32 offsets of each request's tokens
    seq_lens_k: torch.Tensor  # [B] int32 keys each request attends to (cached + new)
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (never read past seq_lens_k)
    logits_indices: torch.Tensor  # [S] rows whose logits sample (info.logits_indices)
    max_seqlen_q: int
    max_seqlen_k: int


def build_batch_inputs(info: SchedulerInfo, block_tables: list[list[int]], block_size: int,
                       device: torch.device | str = "cpu") -> BatchInputs:
    """Flatten a :class:`SchedulerInfo` into the tensors of one varlen forward.

    ``block_tables[i]`` is the block table of request ``info.ids[i]`` (``req.block_table``).
    """
    if len(block_tables) != len(info.ids):
        raise ValueError(f"block_tables has {len(block_tables)} rows for {len(info.ids)} requests")
    lens = torch.tensor(info.chunk_len, dtype=torch.int32)
    starts = torch.tensor(info.kv_len, dtype=torch.int32)
    cu_seqlens_q = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu_seqlens_q[1:])
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
    positions = torch.arange(int(cu_seqlens_q[-1])) - cu_seqlens_q[:-1][seq_ids] + starts[seq_ids]
    width = max(len(bt) for bt in block_tables)
    tables = torch.tensor([bt + [0] * (width - len(bt)) for bt in block_tables], dtype=torch.int32)
    seq_lens_k = starts + lens
    return BatchInputs(
        input_ids=torch.tensor(info.merge_prompt, dtype=torch.long, device=device),
        positions=positions.to(device),
        cu_seqlens_q=cu_seqlens_q.to(device),
        seq_lens_k=seq_lens_k.to(device),
        slot_mapping=build_slot_mapping(tables, positions, block_size, seq_ids).to(device),
        block_tables=tables.to(device),
        logits_indices=torch.tensor(info.logits_indices, dtype=torch.long, device=device),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(seq_lens_k.max()),
    )
