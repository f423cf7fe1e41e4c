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

:class:`SchedulerInfo` describes such a mixed batch as one merged input (``merge_prompt``,
``chunk_len``, ``last_pos`` ...), built from a :class:`scheduler.SchedulerOutput`;
:func:`build_batch_inputs` turns a step into the flat tensors one forward pass needs
(``input_ids``, ``positions``, ``logits_indices``, and chapter 02's ``AttentionMetadata``:
``cu_seqlens_q``, ``seq_lens_k``, ``slot_mapping``, ``block_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attention_backends import AttentionMetadata
from block_manager import BlockManager
from kv_cache import build_slot_mapping
from scheduler import KVConnector, Request, Scheduler, SchedulerOutput
from sequence import Sequence


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

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_gpu_blocks: int,
        policy: str = "fcfs",
        block_size: int = 16,
        block_manager: BlockManager | None = None,
        long_prefill_token_threshold: int | None = None,
        kv_connector: KVConnector | None = None,
    ):
        super().__init__(
            max_num_seqs, max_num_batched_tokens, num_gpu_blocks, policy, block_size, block_manager, kv_connector
        )
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
        # Decodes first: a request that is still prefilling may be earlier in the running list,
        # and would otherwise take the whole budget for its next chunk.
        decoding = [r for r in self.running if r.is_decoding]
        prefilling = [r for r in self.running if not r.is_decoding]
        return decoding + prefilling


@dataclass
class SchedulerInfo:
    """The batch description: every scheduled request's slice of one merged input.

    Row ``i`` is request ``ids[i]``; its tokens are ``merge_prompt[chunk_idx[i] :
    chunk_idx[i] + chunk_len[i]]`` at positions ``kv_len[i] ...``, attending to ``kv_len[i] +
    chunk_len[i]`` keys held in the ``kv_page_len[i]`` blocks of ``block_tables[i]``.
    ``last_pos[i]`` is the index *inside the chunk* whose logits sample the next token, ``-1``
    when the chunk stops short of the end of the prompt (those logits would predict from a
    partial prompt, and are dropped). A decode row may carry ``num_spec[i]`` speculative draft
    tokens at its end: their positions are scored too. Rows come in the scheduler's batch order:
    with :class:`ChunkedPrefillScheduler`, decodes first.
    """

    ids: list[str] = field(default_factory=list)
    chunk_prompts: list[list[int]] = field(default_factory=list)
    chunk_idx: list[int] = field(default_factory=list)
    chunk_len: list[int] = field(default_factory=list)
    merge_prompt: list[int] = field(default_factory=list)
    kv_len: list[int] = field(default_factory=list)
    kv_page_len: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    is_decoding: list[bool] = field(default_factory=list)
    last_pos: list[int] = field(default_factory=list)
    num_spec: list[int] = field(default_factory=list)
    decoding_batch: int = 0
    prefill_batch: int = 0

    def add_row(
        self,
        request_id: str,
        chunk: list[int],
        kv_len: int,
        block_table: list[int],
        samples: bool,
        num_spec: int = 0,
        is_decoding: bool = False,
    ) -> None:
        """Append one request's slice; ``samples`` says whether its last position samples."""
        self.ids.append(request_id)
        self.chunk_prompts.append(chunk)
        self.chunk_idx.append(len(self.merge_prompt))
        self.chunk_len.append(len(chunk))
        self.merge_prompt.extend(chunk)
        self.kv_len.append(kv_len)
        self.kv_page_len.append(len(block_table))
        self.block_tables.append(list(block_table))
        self.is_decoding.append(is_decoding)
        self.last_pos.append(len(chunk) - 1 if samples else -1)
        self.num_spec.append(num_spec)
        self.decoding_batch += is_decoding
        self.prefill_batch += not is_decoding

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> SchedulerInfo:
        """Describe ``out`` (call it between ``schedule()`` and ``update_from_output()``)."""
        info = cls()
        for req in out.scheduled_requests:
            rid = req.request_id
            info.add_row(
                rid,
                out.input_token_ids(req),
                out.num_computed_tokens[rid],
                req.block_table,
                out.produces_token(req),
                len(out.scheduled_spec_decode_tokens.get(rid, ())),
                req.is_decoding,
            )
        return info

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], num_new_tokens: list[int]) -> SchedulerInfo:
        """Describe sequences without a scheduler: ``num_new_tokens[i]`` tokens of ``seqs[i]``
        from its ``num_computed_tokens`` on, sampling when they reach its last token."""
        info = cls()
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            info.add_row(
                getattr(seq, "request_id", str(i)),
                seq.token_ids[start : start + n],
                start,
                seq.block_table,
                samples=start + n == seq.num_tokens,
            )
        return info

    @property
    def num_sample_rows(self) -> list[int]:
        """Rows of logits each request samples from: its drafts plus one, or 0 mid-prompt."""
        return [k + 1 if last >= 0 else 0 for last, k in zip(self.last_pos, self.num_spec)]

    @property
    def logits_indices(self) -> list[int]:
        """Rows of the merged input whose logits sample: each draft position, then the last."""
        return [
            idx + last - k + j
            for idx, last, k in zip(self.chunk_idx, self.last_pos, self.num_spec)
            if last >= 0
            for j in range(k + 1)
        ]


@dataclass
class BatchInputs:
    """The flat tensors of one forward over a mixed batch (``T`` tokens, ``B`` requests): the
    model's inputs, the batch as attention reads it (chapter 02's :class:`AttentionMetadata`:
    ``slot_mapping``, ``cu_seqlens_q``, ``seq_lens_k``, ``block_tables`` padded with 0 and never
    read past ``seq_lens_k``, ``max_seqlen_q``, ``max_seqlen_k``), and the rows that sample."""

    input_ids: torch.Tensor  # [T] merge_prompt
    positions: torch.Tensor  # [T] position of each token in its own request
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows whose logits sample (info.logits_indices)


def build_batch_inputs(info: SchedulerInfo, block_size: int, device: torch.device | str = "cpu") -> BatchInputs:
    """Flatten a :class:`SchedulerInfo` into the tensors of one varlen forward."""
    if not info.ids:
        raise ValueError("info describes an empty batch")
    # Built on the host from Python lists (the host reads lengths back), then copied to `device` once.
    host = torch.device("cpu")
    lens = torch.tensor(info.chunk_len, dtype=torch.int32, device=host)
    starts = torch.tensor(info.kv_len, dtype=torch.int32, device=host)
    cu_seqlens_q = torch.zeros(len(lens) + 1, dtype=torch.int32, device=host)
    torch.cumsum(lens, 0, out=cu_seqlens_q[1:])
    # int64 repeats: with int32 ones torch 2.13's CPU repeat_interleave takes ~2.5 ms instead of ~10 us.
    seq_ids = torch.repeat_interleave(torch.arange(len(lens), device=host), lens.long())
    positions = torch.arange(int(cu_seqlens_q[-1]), device=host) - cu_seqlens_q[:-1][seq_ids] + starts[seq_ids]
    width = max(len(bt) for bt in info.block_tables)
    tables = torch.tensor([bt + [0] * (width - len(bt)) for bt in info.block_tables], dtype=torch.int32, device=host)
    seq_lens_k = starts + lens
    slot_mapping = build_slot_mapping(tables, positions, block_size, seq_ids)

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return BatchInputs(
        input_ids=to(torch.tensor(info.merge_prompt, dtype=torch.long, device=host)),
        positions=to(positions),
        attn_metadata=AttentionMetadata(
            slot_mapping=to(slot_mapping),
            cu_seqlens_q=to(cu_seqlens_q),
            seq_lens_k=to(seq_lens_k),
            block_tables=to(tables),
            max_seqlen_q=int(lens.max()),
            max_seqlen_k=int(seq_lens_k.max()),
        ),
        logits_indices=to(torch.tensor(info.logits_indices, dtype=torch.long, device=host)),
    )
