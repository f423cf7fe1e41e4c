"""Exercises 06.1, 06.2, 06.3, 06.4 of 06_chunked_prefill: your versions of chunked_prefill.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 06_chunked_prefill/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from chunked_prefill import BatchInputs, SchedulerInfo
from kv_cache import build_slot_mapping
from scheduler import KVConnector, Request, Scheduler, SchedulerOutput


def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
    """Chunk size: what is left, capped by the threshold and the budget

    Becomes ``ChunkedPrefillScheduler._num_new_tokens`` (a method: ``self`` is the
    ChunkedPrefillScheduler). Call parent methods as ``Parent.method(self, ...)``, not
    ``super()``.

    Hint: Tokens left (num_tokens - num_computed), capped by long_prefill_token_threshold (when
    set) and by the budget; then add the drafts self._num_spec_tokens allows.

    Checked by: pytest 06_chunked_prefill/ --impl=student --exercise 06.1
    """
    raise NotImplementedError(
        "Exercise 06.1: implement ChunkedPrefillScheduler._num_new_tokens — see 06_chunked_prefill/README.md#exercises"
    )


def _running_order(self) -> list[Request]:
    # Decodes first: a request that is still prefilling may be earlier in the running list,
    # and would otherwise take the whole budget for its next chunk.
    """Decodes first: the order phase 1 visits running requests in

    Becomes ``ChunkedPrefillScheduler._running_order`` (a method: ``self`` is the
    ChunkedPrefillScheduler). Call parent methods as ``Parent.method(self, ...)``, not
    ``super()``.

    Hint: Requests whose prompt is done (decoding) before those still prefilling, each group in
    running order; return a new list (preemption edits self.running while phase 1 walks it).

    Checked by: pytest 06_chunked_prefill/ --impl=student --exercise 06.2
    """
    raise NotImplementedError(
        "Exercise 06.2: implement ChunkedPrefillScheduler._running_order — see 06_chunked_prefill/README.md#exercises"
    )


def from_scheduler_output(cls, out: SchedulerOutput) -> SchedulerInfo:
    """Describe ``out`` (call it between ``schedule()`` and ``update_from_output()``).

    Becomes ``SchedulerInfo.from_scheduler_output`` (a method: ``self`` is the SchedulerInfo).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: One entry per scheduled request, in the output's order: its chunk_len (tokens this
    step), its last_pos, whether it is a prefill, and whether it samples.

    Checked by: pytest 06_chunked_prefill/ --impl=student --exercise 06.3
    """
    raise NotImplementedError(
        "Exercise 06.3: implement SchedulerInfo.from_scheduler_output — see 06_chunked_prefill/README.md#exercises"
    )


def build_batch_inputs(info: SchedulerInfo, block_size: int, device: torch.device | str = "cpu") -> BatchInputs:
    """Flatten a :class:`SchedulerInfo` into the tensors of one varlen forward.

    Hint: cu_seqlens_q is 0 followed by the running sum of the chunk lengths; a row's positions
    run from its kv_len (the tokens already in its cache) for chunk_len tokens; seq_lens_k is
    kv_len + chunk_len; slots come from the block tables (chapter 01's build_slot_mapping),
    which are padded with 0 to the widest; logits_indices is info.logits_indices.

    Checked by: pytest 06_chunked_prefill/ --impl=student --exercise 06.4
    """
    raise NotImplementedError(
        "Exercise 06.4: implement build_batch_inputs — see 06_chunked_prefill/README.md#exercises"
    )
