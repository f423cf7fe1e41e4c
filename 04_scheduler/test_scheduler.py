"""Chapter 04: the two-phase scheduler, its policies, preemption, abort and statistics."""

import pytest

from block_manager import BlockManager
from prefix_block_manager import PrefixCachingBlockManager
from scheduler import EngineCoreOutput, Request, RequestStatus, Scheduler, SchedulerOutput

BS = 4


def req(rid, n, max_tokens=4, **kw):
    return Request(rid, list(range(10, 10 + n)), max_tokens=max_tokens, block_size=BS, **kw)


def step(sched, tokens=None, default=7):
    """One schedule + fake forward: every sampling request gets ``default`` (or ``tokens[rid]``)."""
    out = sched.schedule()
    sampled = {r.request_id: (tokens or {}).get(r.request_id, [default]) for r in out.sampling_requests}
    gained = sched.update_from_output(out, sampled)
    sched.check_invariants()
    return out, gained


def scheduled(out):
    return [(r.request_id, out.num_scheduled_tokens[r.request_id]) for r in out.scheduled_requests]


# ---------------------------------------------------------------------- the types
def test_request_status_and_request_fields():
    assert RequestStatus.FINISHED_LENGTH_CAPPED is RequestStatus.FINISHED_LENGTH  # the README listing's name
    assert [RequestStatus.is_finished(s) for s in RequestStatus] == [False] * 4 + [True] * 4
    r = Request("a", [1, 2, 3], max_tokens=5, priority=2, arrival_time=1.5, eos_token_id=[2, 9], stop_token_ids=[4])
    assert (r.request_id, r.status, r.priority, r.arrival_time, r.max_tokens) == ("a", RequestStatus.WAITING, 2, 1.5, 5)
    assert r.spec_token_ids == [] and r.num_preemptions == 0 and r.stop_token_ids == {2, 9, 4}
    assert Request("b", [1], eos_token_id=2, ignore_eos=True, stop_token_ids=[4]).stop_token_ids == {4}
    assert r.num_prompt_tokens == 3 and r.num_computed_tokens == 0 and r.max_num_kv_tokens == 7
    assert Request("c", [1]).max_tokens == 16
    with pytest.raises(ValueError, match="max_tokens"):
        Request("b", [1], max_tokens=0)
    with pytest.raises(ValueError, match="token_ids"):
        Request("b", [])


def test_the_readme_listing_spelling_runs():
    """The chapter's listing writes requests and reads them with these names: same object."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=100, policy="priority")
    r = Request(request_id="r0", token_ids=[5, 6, 7], max_new_tokens=2, priority=0)
    assert (r.max_tokens, r.prompt_token_ids, r.seq_len, r.remaining_tokens, r.num_blocks_needed) == (
        2,
        [5, 6, 7],
        3,
        3,
        1,
    )
    sched.add_request(r)
    out = sched.schedule()
    assert out.total_tokens == 3 and out.scheduled_requests == [r] and out.preempted_requests == []
    sched.update_from_output(out, {"r0": [9]})
    assert r.output_token_ids == [9] and r.seq_len == 4 and r.remaining_tokens == 1
    sched.update_from_output(sched.schedule(), {"r0": [9]})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and not sched.has_requests()
    with pytest.raises(ValueError, match="prompt_token_ids or token_ids"):
        Request("x", [1], token_ids=[1])
    with pytest.raises(ValueError, match="max_tokens or max_new_tokens"):
        Request("x", [1], max_tokens=2, max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(policy="lifo"), "policy"),
        (dict(block_size=8), "block_size"),
    ],
)
def test_scheduler_rejects_bad_arguments(kwargs, name):
    args = dict(
        max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=8, block_size=BS, block_manager=BlockManager(8, BS)
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        Scheduler(**args)


def test_add_request_rejects_what_could_never_run():
    s = Scheduler(4, 16, 8, block_size=BS)
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="already"):
        s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.add_request(req("long", 17))  # needs chunked prefill (chapter 06)
    with pytest.raises(ValueError, match="recomputed in one step"):
        s.add_request(req("grows", 10, max_tokens=8))  # 17 tokens to recompute after a preemption
    with pytest.raises(ValueError, match="KV blocks"):
        Scheduler(4, 64, 2, block_size=BS).add_request(req("big", 8, max_tokens=2))
    with pytest.raises(ValueError, match="block_size"):
        s.add_request(Request("c", [1, 2], block_size=8))
    assert list(s.requests) == ["a"]


# ---------------------------------------------------------------------- the two phases
def test_prompts_run_whole_then_decode_one_token_each():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=16, block_size=BS)
    s.add_request(a := req("a", 5, max_tokens=3))
    s.add_request(req("b", 9, max_tokens=2))
    out = s.schedule()
    assert not any(r.is_decoding for r in out.scheduled_requests)  # prompts; valid until the update
    gained = s.update_from_output(out, {"a": [7], "b": [7]})
    assert gained == [EngineCoreOutput("a", [7]), EngineCoreOutput("b", [7])]
    assert scheduled(out) == [("a", 5), ("b", 9)] and out.total_num_scheduled_tokens == 14
    assert out.num_computed_tokens == {"a": 0, "b": 0} and out.admitted_request_ids == ["a", "b"]
    assert out.sampling_request_ids == {"a", "b"} and all(r.is_decoding for r in out.scheduled_requests)
    assert s.requests["a"].num_computed_tokens == 5 and s.requests["a"].completion_token_ids == [7]
    out, gained = step(s)
    assert scheduled(out) == [("a", 1), ("b", 1)] and out.num_computed_tokens == {"a": 5, "b": 9}
    assert gained == [EngineCoreOutput("a", [7]), EngineCoreOutput("b", [7], RequestStatus.FINISHED_LENGTH)]
    out, gained = step(s)
    assert scheduled(out) == [("a", 1)] and out.finished_request_ids == {"b"}
    assert gained == [EngineCoreOutput("a", [7], RequestStatus.FINISHED_LENGTH)] and gained[0].finished
    assert a.completion_token_ids == [7, 7, 7] and not s.has_requests()
    assert s.block_manager.all_blocks_free()


def test_a_request_that_does_not_fit_the_budget_takes_no_blocks():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=10, num_gpu_blocks=16, block_size=BS)
    s.add_request(req("a", 6))
    s.add_request(req("b", 8, max_tokens=2))  # 6 + 8 > 10: b waits for the next step
    out = s.schedule()
    b = s.requests["b"]
    assert scheduled(out) == [("a", 6)]
    assert b.block_table == [] and s.block_manager.get_num_free_blocks() == 16 - 2, (
        f"b was not admitted (its 8 tokens exceed the 4 left in the budget), so it must hold no blocks; "
        f"it holds {b.block_table}: ask _num_new_tokens before allocate_slots"
    )


def test_running_requests_come_first_and_new_ones_fill_the_budget():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=12, num_gpu_blocks=32, block_size=BS)
    s.add_request(req("a", 4, max_tokens=6))
    step(s)
    for rid, n, mt in (("b", 8, 4), ("c", 3, 1), ("d", 11, 1)):
        s.add_request(req(rid, n, max_tokens=mt))
    out, _ = step(s)
    assert scheduled(out) == [("a", 1), ("b", 8), ("c", 3)]  # decode first, then whole prompts
    out, _ = step(s)
    assert scheduled(out) == [("a", 1), ("b", 1)]  # d (11) > the 10 left: it waits whole
    assert [r.request_id for r in s.waiting] == ["d"]


class _OneRemoteHit:
    """A global KV pool holding the first two blocks of request "a"'s prompt, and nothing else;
    ``busy`` makes it answer "ask again next step" for request "b"."""

    def __init__(self, busy: bool = False):
        self.busy = busy
        self.promised: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id == "b" and self.busy:
            return None
        return 2 * BS if request.request_id == "a" else 0

    def update_state_after_alloc(self, request, num_external_tokens):
        self.promised[request.request_id] = num_external_tokens

    def request_finished(self, request):
        self.promised.pop(request.request_id, None)


def test_admission_asks_the_kv_connector_first():
    pool = _OneRemoteHit()
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=16, block_size=BS, kv_connector=pool)
    a, c = req("a", 13), req("c", 5)
    sched.add_request(a)
    sched.add_request(c)
    out = sched.schedule()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "a" in sched.loading, (
        f"the KV connector holds 8 of a's prompt tokens: admission (self._start_remote_load) must park "
        f"a in WAITING_FOR_REMOTE_KVS while they load, not compute them; a is {a.status.name}"
    )
    assert pool.promised == {"a": 2 * BS} and scheduled(out) == [("c", 5)], (pool.promised, scheduled(out))


def test_a_request_told_to_wait_for_a_shared_load_holds_the_queue():
    sched = Scheduler(
        max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=16, block_size=BS, kv_connector=_OneRemoteHit(True)
    )
    sched.add_request(req("b", 5))
    sched.add_request(req("c", 5))
    out = sched.schedule()
    assert scheduled(out) == [], (
        "the connector answered None for the head of the queue (another request is loading blocks it "
        f"shares): it waits a step and nothing overtakes it; scheduled {scheduled(out)}"
    )


def test_head_of_line_is_not_overtaken():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=10, num_gpu_blocks=32, block_size=BS)
    s.add_request(req("a", 6, max_tokens=5))
    s.add_request(req("b", 10, max_tokens=1))
    s.add_request(req("c", 2))
    out, _ = step(s)
    assert scheduled(out) == [("a", 6)]  # b does not fit the 4 left, and c may not jump it


def test_max_num_seqs_caps_the_running_set():
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks=32, block_size=BS)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=2))
    out, _ = step(s)
    assert scheduled(out) == [("r0", 3), ("r1", 3)] and len(s.waiting) == 2
    out, _ = step(s)
    assert scheduled(out) == [("r0", 1), ("r1", 1)]
    out, _ = step(s)
    assert scheduled(out) == [("r2", 3), ("r3", 3)]


# ---------------------------------------------------------------------- preemption
def test_fcfs_preempts_the_newest_and_requeues_it_at_the_head():
    # 3 blocks of 4 slots: a and b take one block each for their 4-token prompts; both need a
    # second block for their 5th token, and only one is left.
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=3, block_size=BS)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("b", 4, max_tokens=5))
    step(s)
    b = s.requests["b"]
    out, _ = step(s)
    preempted = [r.request_id for r in out.preempted_requests]
    assert preempted == ["b"] and scheduled(out) == [("a", 1)], (
        f"FCFS preempts the most recently admitted request (the end of self.running), b; preempted {preempted}"
    )
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not b.block_table
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert list(s.waiting) == [b] and b not in s.running  # head of the queue, in one place only
    for _ in range(20):
        if not s.has_requests():
            break
        step(s)
    assert b.status == RequestStatus.FINISHED_LENGTH and b.completion_token_ids == [7] * 5
    assert s.block_manager.all_blocks_free()


def test_no_admission_in_a_step_that_preempted():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=4, block_size=BS)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("b", 8, max_tokens=5))
    step(s)  # a holds 1 block, b 2, 1 is free
    s.add_request(req("c", 2))
    out, _ = step(s)  # a takes the free block, b (newest) is preempted and frees 2
    assert [r.request_id for r in out.preempted_requests] == ["b"] and scheduled(out) == [("a", 1)]
    assert s.block_manager.get_num_free_blocks() == 2  # c would fit, yet waits a step
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    out, _ = step(s)  # b's recompute needs 3 blocks, 2 are free; c may not overtake it
    assert scheduled(out) == [("a", 1)]


def test_priority_preempts_least_important_latest_arrival():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=3, policy="priority", block_size=BS)
    s.add_request(req("low_old", 4, max_tokens=5, priority=1, arrival_time=0.0))
    s.add_request(req("high", 4, max_tokens=5, priority=0, arrival_time=1.0))
    s.add_request(req("low_new", 4, max_tokens=5, priority=1, arrival_time=2.0))
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled_requests] == ["high", "low_old", "low_new"]  # queue order
    out, _ = step(s)  # every request needs its second block; none is free
    preempted = [r.request_id for r in out.preempted_requests]
    assert preempted == ["low_new", "low_old"], (
        f"a larger priority value is less important, and of equal priorities the later arrival goes first: "
        f"expected low_new then low_old, preempted {preempted}"
    )
    assert scheduled(out) == [("high", 1)]
    assert [r.request_id for r in s.waiting] == ["low_old", "low_new"]


def test_priority_self_preemption_lets_the_others_run():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=2, policy="priority", block_size=BS)
    s.add_request(req("unimportant", 3, max_tokens=5, priority=5, arrival_time=0.0))
    step(s)
    s.add_request(req("vip", 2, max_tokens=5, priority=0, arrival_time=1.0))
    step(s)  # running order: unimportant, vip; one block each, none free
    out, _ = step(s)  # unimportant needs a block and is its own victim; vip still runs
    assert [r.request_id for r in out.preempted_requests] == ["unimportant"]
    assert scheduled(out) == [("vip", 1)]


def test_priority_unschedules_a_victim_scheduled_earlier_in_the_step():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=3, policy="priority", block_size=BS)
    s.add_request(req("low", 2, max_tokens=9, priority=9, arrival_time=0.0))
    step(s)
    s.add_request(req("filler", 2, max_tokens=9, priority=0, arrival_time=0.5))
    s.add_request(req("high", 4, max_tokens=9, priority=0, arrival_time=1.0))
    step(s)  # running order: low, filler, high; one block each, none free
    out, _ = step(s)
    # low decodes inside its block and is scheduled first; high then needs a block, and the
    # least important running request is low: it is taken back out of this step's batch.
    assert [r.request_id for r in out.preempted_requests] == ["low"]
    assert scheduled(out) == [("filler", 1), ("high", 1)]
    assert out.num_computed_tokens == {"filler": 2, "high": 4} and out.sampling_request_ids == {"filler", "high"}
    assert out.total_num_scheduled_tokens == 2


# ---------------------------------------------------------------------- abort and finish
def test_abort_in_every_state_returns_the_blocks():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=3, block_size=BS)
    s.add_request(req("run", 4, max_tokens=8))
    s.add_request(req("pre", 4, max_tokens=8))
    step(s)
    step(s)  # "pre" is preempted
    s.add_request(req("wait", 3))
    assert s.requests["pre"].status == RequestStatus.PREEMPTED
    for rid in ("pre", "wait"):
        r = s.requests[rid]
        assert s.abort_request(rid) and r.status == RequestStatus.FINISHED_ABORTED
        s.check_invariants()
    out = s.schedule()  # abort between schedule and update: the update skips it
    assert out.finished_request_ids == {"pre", "wait"}
    assert s.abort_request("run")
    assert s.update_from_output(out, {"run": [7]}) == []
    s.check_invariants()
    assert not s.has_requests() and s.block_manager.all_blocks_free()
    assert not s.abort_request("run") and not s.abort_request("nobody")


def test_finish_request_for_a_stop_string():
    s = Scheduler(4, 64, 8, block_size=BS)
    s.add_request(req("a", 5, max_tokens=10))
    step(s)
    assert s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert s.block_manager.all_blocks_free() and s.get_stats()["num_finished"] == 1
    with pytest.raises(ValueError, match="status"):
        s.finish_request("a", RequestStatus.RUNNING)


def test_eos_stops_unless_ignored():
    s = Scheduler(4, 64, 16, block_size=BS)
    s.add_request(req("stops", 3, max_tokens=10, eos_token_id=2))
    s.add_request(req("ignores", 3, max_tokens=3, eos_token_id=2, ignore_eos=True))
    ignores = s.requests["ignores"]
    _, gained = step(s, default=2)
    ended = [(g.request_id, g.finish_reason) for g in gained if g.finished]
    assert ended == [("stops", RequestStatus.FINISHED_STOPPED)]
    step(s, default=2)
    _, gained = step(s, default=2)
    assert gained == [EngineCoreOutput("ignores", [2], RequestStatus.FINISHED_LENGTH)]
    assert ignores.completion_token_ids == [2, 2, 2]


def test_update_rejects_missing_or_extra_tokens():
    s = Scheduler(4, 64, 8, block_size=BS)
    s.add_request(req("a", 3))
    out = s.schedule()
    with pytest.raises(ValueError, match="sampled_token_ids"):
        s.update_from_output(out, {})
    with pytest.raises(ValueError, match="sampled_token_ids"):
        s.update_from_output(out, {"a": [1, 2]})  # no drafts were scheduled: exactly one token


# ---------------------------------------------------------------------- speculative tokens
def test_spec_tokens_ride_on_decode_and_rejected_ones_are_recomputed():
    s = Scheduler(4, 64, 16, block_size=BS)
    a = req("a", 5, max_tokens=10)
    s.add_request(a)
    step(s)
    a.spec_token_ids = [11, 12, 13]
    out = s.schedule()
    assert scheduled(out) == [("a", 4)] and out.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert out.input_token_ids(a) == [7, 11, 12, 13] and out.num_computed_tokens["a"] == 5
    assert a.is_decoding
    s.update_from_output(out, {"a": [11, 12, 99]})  # 2 of 3 accepted, then the model's own token
    assert a.completion_token_ids == [7, 11, 12, 99] and a.num_computed_tokens == 8 == a.num_tokens - 1
    assert a.spec_token_ids == []


def test_spec_tokens_trimmed_by_budget_and_max_tokens():
    s = Scheduler(4, 8, 16, block_size=BS)
    a = req("a", 5, max_tokens=3)
    s.add_request(a)
    step(s)
    a.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1]}  # 2 tokens left to generate: 1 draft is useful
    s.update_from_output(out, {"a": [1, 5]})
    assert a.is_finished and a.completion_token_ids == [7, 1, 5]
    s2 = Scheduler(4, 12, 32, block_size=BS)
    b, c = req("b", 2, max_tokens=11), req("c", 2, max_tokens=11)
    s2.add_request(b)
    s2.add_request(c)
    step(s2)
    b.spec_token_ids = list(range(20, 40))
    c.spec_token_ids = list(range(40, 60))
    out = s2.schedule()
    assert scheduled(out) == [("b", 10), ("c", 2)]  # b: 1 + 9 useful drafts; c: what is left
    assert out.scheduled_spec_decode_tokens == {"b": list(range(20, 29)), "c": [40]}


def test_eos_among_accepted_drafts_truncates():
    s = Scheduler(4, 64, 16, block_size=BS)
    a = req("a", 5, max_tokens=10, eos_token_id=2)
    s.add_request(a)
    step(s)
    a.spec_token_ids = [2, 8, 9]
    out = s.schedule()
    gained = s.update_from_output(out, {"a": [2, 8, 9, 4]})
    assert gained == [EngineCoreOutput("a", [2], RequestStatus.FINISHED_STOPPED)], "tokens after the stop are dropped"
    assert a.completion_token_ids == [7, 2] and a.status == RequestStatus.FINISHED_STOPPED
    assert s.block_manager.all_blocks_free()


# ---------------------------------------------------------------------- prefix caching
def test_prefix_hits_count_as_computed_and_last_token_is_recomputed():
    bm = PrefixCachingBlockManager(16, BS)
    s = Scheduler(4, 64, 16, block_size=BS, block_manager=bm)
    s.add_request(Request("a", list(range(12)), max_tokens=1, block_size=BS))
    step(s)
    s.add_request(Request("same", list(range(12)), max_tokens=1, block_size=BS))
    s.add_request(Request("longer", list(range(14)), max_tokens=1, block_size=BS))
    out = s.schedule()
    # "same" hits 2 of its 3 blocks (the last token is recomputed), "longer" hits all 3.
    assert out.num_computed_tokens == {"same": 8, "longer": 12}, (
        f"prefix hits are already computed: a request starts at its hit tokens, got {out.num_computed_tokens}"
    )
    assert scheduled(out) == [("same", 4), ("longer", 2)]
    assert s.requests["longer"].num_cached_tokens == 12
    s.update_from_output(out, {"same": [1], "longer": [1]})
    stats = s.get_stats()
    assert stats["prefix_cache_queries"] == 12 + 12 + 14 and stats["prefix_cache_hits"] == 8 + 12
    assert bm.all_blocks_free()


def test_a_readmission_keeps_the_cached_tokens_of_the_first_admission():
    """num_cached_tokens is what the prefix cache saved a request when it was first admitted: back
    after a preemption, it re-hits blocks it computed itself, which saves nothing new."""
    bm = PrefixCachingBlockManager(6, BS)
    s = Scheduler(4, 64, 6, block_size=BS, block_manager=bm)
    s.add_request(Request("c", list(range(100, 105)), max_tokens=1, block_size=BS))
    step(s)  # c leaves its first block [100..103] in the cache
    s.add_request(Request("a", list(range(8)), max_tokens=7, block_size=BS))
    s.add_request(Request("b", list(range(100, 108)), max_tokens=7, block_size=BS))
    out, _ = step(s)
    b = s.requests["b"]
    assert out.num_computed_tokens["b"] == 4 and b.num_cached_tokens == 4  # c's block was a hit
    while b.num_preemptions == 0:  # a and b decode until the cache runs out and b, the newer, goes
        step(s)
    while b.status != RequestStatus.RUNNING:
        out, _ = step(s)
    assert out.num_computed_tokens["b"] == 8, "back in, b hits both of its prompt's blocks"
    assert b.num_cached_tokens == 4, (
        f"b's num_cached_tokens became {b.num_cached_tokens} on its re-admission: only a request's first "
        "admission (num_preemptions == 0) sets it; its own blocks found again are no cache saving"
    )


def test_preempted_request_resumes_with_prefix_hits():
    bm = PrefixCachingBlockManager(5, BS)
    s = Scheduler(4, 64, 5, block_size=BS, block_manager=bm)
    s.add_request(Request("a", list(range(8)), max_tokens=5, block_size=BS))
    s.add_request(Request("b", list(range(100, 108)), max_tokens=5, block_size=BS))
    step(s)
    out, _ = step(s)  # a takes the last free block for its 9th token; b needs one too: preempted
    b = s.requests["b"]
    assert out.preempted_requests == [b] and b.num_preemptions == 1
    while b.status != RequestStatus.RUNNING:
        out, _ = step(s)
    # b's two full blocks stayed in the cache (refcount 0) and are hit on the way back: only
    # its 9th token (the one it had sampled) is recomputed. Its num_cached_tokens still says
    # what its first admission found (nothing): it computed those blocks itself.
    assert out.num_computed_tokens["b"] == 8 and b.num_cached_tokens == 0
    assert scheduled(out)[-1] == ("b", 1)
    while s.has_requests():
        step(s)
    assert b.completion_token_ids == [7] * 5 and bm.all_blocks_free()


def test_stats_without_prefix_cache():
    s = Scheduler(4, 64, 10, block_size=BS)
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    out = s.schedule()
    stats = s.get_stats()
    assert stats["num_running"] == 2 and stats["num_waiting"] == 0 and stats["num_preemptions"] == 0
    assert stats["kv_cache_usage"] == pytest.approx(4 / 10) and s.block_manager.get_num_free_blocks() == 6
    assert "prefix_cache_hits" not in stats
    assert isinstance(out, SchedulerOutput)
