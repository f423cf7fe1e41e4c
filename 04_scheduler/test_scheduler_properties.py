"""Property tests: thousands of random scheduler steps against a fake model (``scheduler_testing``).

Each seed is a random workload (cache and budget sizes, arrivals, prompt lengths with shared
prefixes, max_tokens, priorities, EOS, aborts, speculative drafts). After every step the driver
checks the step's batch and the scheduler's invariants; at the end it checks that every request
finished with exactly the tokens the fake model would generate alone, and that every block is
back. The totals below make sure the workloads really exercised preemption and drafts.
"""

import pytest

from prefill_first import PrefillFirstScheduler
from scheduler import Scheduler
from scheduler_testing import run_random_workload

SEEDS = range(500)

# What a total far below its floor usually means: the scheduler never reached that path.
WHY = {
    "num_steps": "the workloads ended early",
    "num_preemptions": "no request was ever preempted: does phase 1 call _preempt when allocate_slots fails?",
    "num_aborted": "no abort reached the scheduler",
    "num_spec_accepted": "no draft token was accepted: are drafts scheduled (_num_spec_tokens)?",
    "num_finished": "requests did not finish",
    "num_remote_tokens": "no token was loaded from the global pool: does admission (_schedule_waiting) ask "
    "self._start_remote_load(req) before self._admit?",
}


def _exercised(results, **floors: int) -> None:
    """Each total over the workloads exceeds its floor: the run really took those paths."""
    for name, floor in floors.items():
        total = sum(getattr(r, name) for r in results)
        assert total > floor, f"{name} summed to {total} over {len(results)} workloads, expected > {floor}: {WHY[name]}"


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["paged", "prefix_cache"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_two_phase(policy, prefix_caching):
    results = [run_random_workload(Scheduler, seed, policy=policy, prefix_caching=prefix_caching) for seed in SEEDS]
    _exercised(results, num_steps=4000, num_preemptions=50, num_aborted=10, num_spec_accepted=500, num_finished=500)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["paged", "prefix_cache"])
def test_random_workloads_prefill_first(prefix_caching):
    results = [run_random_workload(PrefillFirstScheduler, seed, prefix_caching=prefix_caching) for seed in SEEDS]
    _exercised(results, num_steps=4000, num_preemptions=50)


def test_the_driver_catches_a_lost_block():
    class LeakyScheduler(Scheduler):
        def _preempt(self, req):  # the classic bug: forget to return the victim's blocks
            self.block_manager.free = lambda seq: None
            super()._preempt(req)

    with pytest.raises(AssertionError):
        for seed in SEEDS:
            run_random_workload(LeakyScheduler, seed)


def test_the_driver_catches_the_seed_livelock():
    class SeedScheduler(Scheduler):
        def _preempt(self, req):  # the double-queue bug: the victim stays running *and* waits
            super()._preempt(req)
            self.running.append(req)

    with pytest.raises(AssertionError):
        for seed in SEEDS:
            run_random_workload(SeedScheduler, seed)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_loading_from_a_global_pool(policy):
    """Admissions that park in WAITING_FOR_REMOTE_KVS, loads that deliver only part of what was
    promised, aborts while loading: every request still ends with its true tokens, no block lost."""
    results = [run_random_workload(Scheduler, seed, policy=policy, prefix_caching=True, remote=True) for seed in SEEDS]
    _exercised(results, num_remote_tokens=1000, num_aborted=10, num_preemptions=50)
