"""Exercise 07.2 of 07_engine: your versions of vllm_from_scratch/model_runner.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from kv_cache import allocate_kv_cache, build_slot_mapping, bytes_per_block, num_blocks_for_budget
from vllm_from_scratch.model_runner import ModelInput


def prepare_inputs(self, requests: list, num_scheduled_tokens: list[int]) -> ModelInput:
    """Flatten the scheduled tokens of every request into one batch (see the module doc).

    Becomes ``ModelRunner.prepare_inputs`` (a method: ``self`` is the ModelRunner). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: For each request, its scheduled tokens start at num_computed_tokens: token ids,
    positions, slots (chapter 01's build_slot_mapping), cu_seqlens_q, seq_lens_k and padded
    block tables; sample only requests whose scheduled tokens reach the end of their known
    tokens.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.2
    """
    raise NotImplementedError("Exercise 07.2: implement ModelRunner.prepare_inputs — see 07_engine/README.md#exercises")
