"""Chapter 04's random-workload driver, run through the batch tensors the engine's runner uses.

:class:`FakeBatchModel` replaces chapter 04's fake model: it never looks at a request. It reads
the step exactly as the engine's model runner does, through :meth:`SchedulerInfo.from_scheduler_output`
and :func:`build_batch_inputs`, writes each new token into the fake KV cache at its slot, reads
every sampling row's context back *from the cache* through the block table (checking each
slot holds the position it should), and verifies drafts with chapter 05's greedy
:func:`spec_decode.rejection_sampling_batched`. A wrong position, slot, block table, logits row
or draft layout then shows up as a wrong token, which the driver's final check catches.
"""

from __future__ import annotations

import torch

from chunked_prefill import SchedulerInfo, build_batch_inputs
from scheduler import SchedulerOutput
from scheduler_testing import FakeModel, true_next_token
from spec_decode import rejection_sampling_batched


class FakeBatchModel(FakeModel):
    """A fake model whose forward sees only :class:`chunked_prefill.BatchInputs`."""

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        if out.is_empty():
            return {}
        info = SchedulerInfo.from_scheduler_output(out)
        batch = build_batch_inputs(info, self.bm.block_size)
        input_ids = batch.input_ids.tolist()
        for token, slot, pos in zip(input_ids, batch.attn_metadata.slot_mapping.tolist(), batch.positions.tolist()):
            self.kv[slot] = (token, pos)
        self.num_forward_tokens += len(input_ids)
        rows = batch.logits_indices.tolist()
        if not rows:
            return {}
        predicted = [true_next_token(self._context(info, row), self.vocab_size) for row in rows]
        counts = [n for n in info.num_sample_rows if n]
        cu_num_logits = torch.tensor([0] + counts).cumsum(0)
        sampled, num_sampled = rejection_sampling_batched(
            torch.tensor(predicted), torch.tensor([input_ids[r] for r in rows]), cu_num_logits, max(counts) - 1
        )
        sampling_ids = [rid for rid, n in zip(info.ids, info.num_sample_rows) if n]
        return {rid: row[:n] for rid, row, n in zip(sampling_ids, sampled.tolist(), num_sampled.tolist())}

    def _context(self, info: SchedulerInfo, row: int) -> list[int]:
        """The tokens at positions ``0..p`` of row ``row``'s request, read through its block table."""
        i = max(j for j, start in enumerate(info.chunk_idx) if start <= row)
        pos = info.kv_len[i] + row - info.chunk_idx[i]
        bs, table = self.bm.block_size, info.block_tables[i]
        context = []
        for p in range(pos + 1):
            entry = self.kv[table[p // bs] * bs + p % bs]
            assert entry is not None and entry[1] == p, f"{info.ids[i]}: position {p} reads {entry}"
            context.append(entry[0])
        return context
