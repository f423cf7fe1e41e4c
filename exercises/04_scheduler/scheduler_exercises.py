"""Exercises 04.1, 04.2, 04.3, 04.4 of 04_scheduler: your versions of scheduler.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 04_scheduler/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from scheduler import Request, SchedulerOutput


def _select_victim(self) -> Request:
    """Choose the preemption victim: FCFS or priority

    Becomes ``Scheduler._select_victim`` (a method: ``self`` is the Scheduler). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: FCFS: the most recently admitted running request (the end of self.running). Priority:
    the least important, latest arrival: the max of (priority, arrival_time), the later admitted
    winning a tie (scan reversed(self.running)).

    Checked by: pytest 04_scheduler/ --impl=student --exercise 04.1
    """
    raise NotImplementedError(
        "Exercise 04.1: implement Scheduler._select_victim — see 04_scheduler/README.md#exercises"
    )


def _preempt(self, req: Request) -> None:
    """Preempt by recompute: free the blocks, requeue at the head

    Becomes ``Scheduler._preempt`` (a method: ``self`` is the Scheduler). Call parent methods as
    ``Parent.method(self, ...)``, not ``super()``.

    Hint: Remove it from self.running, free its blocks, reset num_computed_tokens and its draft
    tokens, mark it PREEMPTED, count it, and self.waiting.add_preempted(req).

    Checked by: pytest 04_scheduler/ --impl=student --exercise 04.2
    """
    raise NotImplementedError("Exercise 04.2: implement Scheduler._preempt — see 04_scheduler/README.md#exercises")


def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> tuple[list[Request], int]:
    """Phase 2: admit waiting (new or preempted) requests, in queue order, while they fit.

    Becomes ``Scheduler._schedule_waiting`` (a method: ``self`` is the Scheduler). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Loop while there are waiting requests, budget, and room under max_num_seqs (requests
    in self.running and self.loading both count). First ask self._start_remote_load(req) of the
    head: None means wait a step (stop), True means it was parked to load from the global pool
    (go on to the next). Otherwise self._admit it (0 means it does not fit: stop, nothing
    overtakes it), pop it from self.waiting, mark it RUNNING, move it to running, self._record
    it, spend its tokens. Return (scheduled, budget).

    Checked by: pytest 04_scheduler/ --impl=student --exercise 04.3
    """
    raise NotImplementedError(
        "Exercise 04.3: implement Scheduler._schedule_waiting — see 04_scheduler/README.md#exercises"
    )


def _admit(self, req: Request, budget: int) -> int:
    """Try to start ``req``: attach its prefix-cache hits and the slots of its first tokens.

    Becomes ``Scheduler._admit`` (a method: ``self`` is the Scheduler). Call parent methods as
    ``Parent.method(self, ...)``, not ``super()``.

    Hint: Ask self.block_manager.get_computed_blocks(req) for the hits (already capped so the
    last token is recomputed), ask self._num_new_tokens from the hit position, allocate_slots
    with the hits; on success set num_computed_tokens to the hit tokens, and num_cached_tokens
    too if this is the request's first admission (num_preemptions == 0).

    Checked by: pytest 04_scheduler/ --impl=student --exercise 04.4
    """
    raise NotImplementedError("Exercise 04.4: implement Scheduler._admit — see 04_scheduler/README.md#exercises")
