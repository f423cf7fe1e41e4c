"""Chapter 04's exercises against the book's own methods, on drawn workloads (exercises/differential.py).

Two schedulers take the same random workload step by step (scheduler_testing.run_in_lockstep): one
with the method in place, one with the book's. Drawn: policy, cache size from "one request barely
fits" up, token budget, max_num_seqs, prefix caching, a global KV pool that holds part of some
prompts (or asks a request to wait a step), prompts sharing prefixes, arrivals, priorities and
arrival times with ties, max_tokens, EOS, drafts, aborts before and after a schedule. After every
step the two must have scheduled, preempted, admitted and finished the same requests and hold the
same queues and blocks.
"""

from __future__ import annotations

from scheduler import Scheduler
from scheduler_testing import run_in_lockstep

MEANINGS = {
    "_select_victim": "the victim is the newest running request (FCFS), or with priorities the largest "
    "(priority, arrival_time), the later admitted winning a tie",
    "_preempt": "a preempted request leaves the running list, frees its blocks, restarts from token 0 without "
    "drafts, is marked PREEMPTED and counted, and goes back to the head of the waiting queue",
    "_schedule_waiting": "waiting requests are admitted in queue order while the budget, max_num_seqs (running "
    "and loading) and the cache allow; the global pool is asked first; a head that does not fit stops the "
    "queue, nothing overtakes it",
    "_admit": "admission attaches the prefix hits, schedules from the hit position, and sets num_cached_tokens "
    "only on a request's first admission",
}


def _lockstep(differential, method: str) -> None:
    book = differential.twin(Scheduler, method)
    differential.run(
        lambda rng: run_in_lockstep(Scheduler, book, rng, differential, f"{method}: {MEANINGS[method]}"),
        examples=120,
    )


def test_select_victim(differential):
    _lockstep(differential, "_select_victim")


def test_preempt(differential):
    _lockstep(differential, "_preempt")


def test_schedule_waiting(differential):
    _lockstep(differential, "_schedule_waiting")


def test_admit(differential):
    _lockstep(differential, "_admit")
