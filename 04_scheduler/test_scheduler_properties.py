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


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["paged", "prefix_cache"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_two_phase(policy, prefix_caching):
    results = [run_random_workload(Scheduler, seed, policy=policy, prefix_caching=prefix_caching) for seed in SEEDS]
    assert sum(r.num_steps for r in results) > 4000
    assert sum(r.num_preemptions for r in results) > 50
    assert sum(r.num_aborted for r in results) > 10
    assert sum(r.num_spec_accepted for r in results) > 500
    assert sum(r.num_finished for r in results) > 500


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["paged", "prefix_cache"])
def test_random_workloads_prefill_first(prefix_caching):
    results = [run_random_workload(PrefillFirstScheduler, seed, prefix_caching=prefix_caching) for seed in SEEDS]
    assert sum(r.num_steps for r in results) > 4000
    assert sum(r.num_preemptions for r in results) > 50


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
    assert sum(r.num_remote_tokens for r in results) > 1000
    assert sum(r.num_aborted for r in results) > 10
    assert sum(r.num_preemptions for r in results) > 50
