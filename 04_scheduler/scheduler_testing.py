"""A seeded random driver that runs a scheduler against a fake model and checks it at every step.

The fake model is deterministic: the token after a prefix is a hash of that prefix. So every
request has one *true* completion, whatever the batching, chunking, prefix hits, preemptions or
speculative drafts on the way, and the driver can compare the scheduler's final outputs with it.
The model keeps a fake KV cache (the token and position written into every slot) and, before a
request's forward, checks that its block table really holds its whole computed prefix: a block
lost, shared by mistake or hit in the prefix cache with the wrong content fails right there.

Chapter 04's tests and chapter 06's (with chunking on) both run :func:`run_random_workload`;
import it, never copy it. Chapter 06 passes its own model class, which reads the step through
the batch tensors the engine's model runner builds, instead of through :class:`SchedulerOutput`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from block_manager import BlockManager, cdiv
from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

EOS = 0


def true_next_token(prefix: list[int], vocab_size: int) -> int:
    """The fake model's greedy choice after ``prefix``: a deterministic hash of the prefix."""
    h = len(prefix)
    for t in prefix[-6:]:
        h = (h * 1_000_003 + t * 7919 + 17) % 2_147_483_647
    return h % vocab_size


def true_completion(prompt: list[int], max_tokens: int, vocab_size: int, ignore_eos: bool) -> list[int]:
    tokens, out = list(prompt), list[int]()
    while len(out) < max_tokens:
        t = true_next_token(tokens, vocab_size)
        tokens.append(t)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


class FakeModel:
    """Runs a :class:`SchedulerOutput` the way a real model runner would, on a fake KV cache."""

    def __init__(self, block_manager: BlockManager, vocab_size: int):
        self.bm = block_manager
        self.vocab_size = vocab_size
        self.kv: list[tuple[int, int] | None] = [None] * (block_manager.num_blocks * block_manager.block_size)
        self.num_forward_tokens = 0

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req in out.scheduled_requests:
            rid = req.request_id
            start = out.num_computed_tokens[rid]
            tokens = out.input_token_ids(req)
            assert len(tokens) == out.num_scheduled_tokens[rid]
            slots = self.bm.slot_mapping(req, 0, start + len(tokens))
            for p in range(start):  # attention reads the cached prefix: it must be this request's
                assert self.kv[slots[p]] == (req.token_ids[p], p), (
                    f"{rid}: slot {slots[p]} (position {p}) holds {self.kv[slots[p]]}, not {req.token_ids[p]}"
                )
            for i, t in enumerate(tokens):
                self.kv[slots[start + i]] = (t, start + i)
            self.num_forward_tokens += len(tokens)
            if out.produces_token(req):
                sampled[rid] = self._verify(
                    req.token_ids[:start] + tokens, out.scheduled_spec_decode_tokens.get(rid, [])
                )
        return sampled

    def _verify(self, fed: list[int], drafts: list[int]) -> list[int]:
        """Greedy draft verification: accepted drafts, then the model's own next token."""
        base = len(fed) - len(drafts)
        result = []
        for j in range(len(drafts) + 1):
            t = true_next_token(fed[: base + j], self.vocab_size)
            result.append(t)
            if j == len(drafts) or drafts[j] != t:
                break
        return result


class FakeConnector:
    """A global KV pool that, by chance, holds some more blocks of an admitted request's prompt.

    ``load(model, rng)`` plays the engine's part before a step: every pending load delivers a
    random whole number of its promised blocks (fewer is a fault the request must survive by
    computing the rest), written into the fake KV cache as a remote engine computed them. While
    loads are pending it sometimes answers "ask again next step", as the engine's connector does
    for a request whose blocks another request is loading.
    """

    def __init__(self, rng: random.Random, block_size: int, p_hit: float):
        self.rng = rng
        self.block_size = block_size
        self.p_hit = p_hit
        self.pending: dict[str, tuple[Request, int]] = {}
        self.num_promised = self.num_loaded = 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        max_blocks = (request.num_tokens - 1) // self.block_size - num_computed_tokens // self.block_size
        if max_blocks <= 0 or self.rng.random() >= self.p_hit:
            return 0
        if self.pending and self.rng.random() < 0.3:
            return None  # as if an earlier admission were loading blocks this request shares
        return self.rng.randint(1, max_blocks) * self.block_size

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self.pending[request.request_id] = (request, num_external_tokens)
        self.num_promised += num_external_tokens

    def request_finished(self, request: Request) -> None:
        self.pending.pop(request.request_id, None)

    def load(self, model: FakeModel) -> dict[str, int]:
        loaded = {}
        for rid, (req, promised) in self.pending.items():
            n = self.rng.randint(0, promised // self.block_size) * self.block_size
            start = req.num_computed_tokens
            slots = model.bm.slot_mapping(req, start, start + n)
            for p, slot in zip(range(start, start + n), slots):
                model.kv[slot] = (req.token_ids[p], p)
            loaded[rid] = n
            self.num_loaded += n
        self.pending = {}
        return loaded


@dataclass
class WorkloadResult:
    seed: int
    num_steps: int = 0
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    num_forward_tokens: int = 0
    num_spec_accepted: int = 0
    num_remote_tokens: int = 0
    params: dict = field(default_factory=dict)


def check_gained(gained: list, live: list[Request], tokens_before: dict[str, int], seed: int) -> None:
    """``update_from_output``'s return: one output per request that sampled and still ran, in
    batch order, holding exactly the tokens it gained and, if it ended, its final status."""
    assert [g.request_id for g in gained] == [r.request_id for r in live], f"seed {seed}: {gained}"
    for g, req in zip(gained, live):
        assert g.new_token_ids == req.token_ids[tokens_before[req.request_id] :], f"seed {seed}: {g}"
        assert g.finish_reason == (req.status if req.is_finished else None), f"seed {seed}: {g}, {req}"


def check_output(
    sched: Scheduler, out: SchedulerOutput, running_before: set[str], threshold: int | None = None
) -> None:
    """Step-level properties every scheduler must keep (``running_before``: ids before the step)."""
    ids = [r.request_id for r in out.scheduled_requests]
    assert len(ids) == len(set(ids)), f"a request scheduled twice: {ids}"
    assert set(ids) == set(out.num_scheduled_tokens), "scheduled requests and token counts disagree"
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens, "token budget exceeded"
    assert len(ids) <= sched.max_num_seqs, "max_num_seqs exceeded"
    preempted = {r.request_id for r in out.preempted_requests}
    assert not preempted & set(ids), "a preempted request was scheduled in the same step"
    if sched.has_requests():
        # A step that only starts loads from a pool makes progress too: they run next step.
        assert out.scheduled_requests or sched.loading, "no progress: requests are waiting but nothing was scheduled"
    if out.preempted_requests:
        assert all(r.request_id in running_before for r in out.scheduled_requests), (
            "a waiting request was admitted in a step that preempted"
        )
    for req in out.scheduled_requests:
        n = out.num_scheduled_tokens[req.request_id]
        start = out.num_computed_tokens[req.request_id]
        num_spec = len(out.scheduled_spec_decode_tokens.get(req.request_id, ()))
        assert n >= 1 and req.status == RequestStatus.RUNNING
        assert start == req.num_computed_tokens
        assert start + n - num_spec <= req.num_tokens
        assert len(req.block_table) * sched.block_size >= start + n, "slots not reserved"
        if not sched.chunked_prefill:
            assert out.produces_token(req), "without chunking every scheduled request samples"
        if threshold is not None and start < req.num_tokens - 1:
            assert n - num_spec <= threshold, "a prefill chunk exceeds long_prefill_token_threshold"


def run_random_workload(
    make_scheduler: Callable[..., Scheduler],
    seed: int,
    *,
    prefix_caching: bool = False,
    chunked: bool = False,
    policy: str | None = None,
    spec: bool = True,
    max_steps: int = 5000,
    model_cls: type[FakeModel] = FakeModel,
    remote: bool = False,
) -> WorkloadResult:
    """Drive one random workload to the end, asserting invariants after every step.

    ``make_scheduler(max_num_seqs=, max_num_batched_tokens=, num_gpu_blocks=, policy=,
    block_size=, block_manager=)`` builds the scheduler under test. Random: block size, cache
    size (from "one request barely fits" up), ``max_num_seqs``, token budget, arrival steps,
    prompt lengths (sharing prefixes, so the prefix cache hits), ``max_tokens``, priorities,
    ``ignore_eos``, aborts (between steps and between a schedule and its update), and draft
    tokens (right or wrong). ``model_cls`` runs each step (a :class:`FakeModel` or a subclass).
    ``remote`` adds a :class:`FakeConnector`: admitted requests may load part of their prompt
    from a pool first, and loads deliver random shares of what was promised.
    Returns counters; raises AssertionError on any violation.
    """
    rng = random.Random(seed)
    vocab = rng.choice([16, 40, 200])  # small vocabularies hit EOS often
    bs = rng.choice([1, 2, 4, 8])
    num_requests = rng.randint(1, 12)
    max_prompt = rng.randint(1, 40)
    max_out = rng.randint(1, 24)
    longest = max_prompt + max_out - 1
    num_blocks = cdiv(longest, bs) + rng.choice([0, 0, 1, 3, 8, 30])
    budget = rng.randint(1, 3 * longest) if chunked else rng.randint(longest, 3 * longest)
    threshold = rng.choice([None, None, rng.randint(1, 16)]) if chunked else None
    max_num_seqs = rng.randint(1, 6)
    policy = policy or rng.choice(["fcfs", "priority"])
    if prefix_caching:
        from prefix_block_manager import PrefixCachingBlockManager

        bm: BlockManager = PrefixCachingBlockManager(num_blocks, bs)
    else:
        bm = BlockManager(num_blocks, bs)
    kwargs = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        num_gpu_blocks=num_blocks,
        policy=policy,
        block_size=bs,
        block_manager=bm,
    )
    if threshold is not None:
        kwargs["long_prefill_token_threshold"] = threshold
    connector = FakeConnector(rng, bs, rng.choice([0.3, 0.8])) if remote else None
    if connector is not None:
        kwargs["kv_connector"] = connector
    sched = make_scheduler(**kwargs)
    model = model_cls(bm, vocab)
    res = WorkloadResult(
        seed,
        num_requests=num_requests,
        params=dict(kwargs, block_manager=type(bm).__name__, vocab=vocab, kv_connector=remote),
    )

    bases = [[rng.randrange(1, vocab) for _ in range(max_prompt)] for _ in range(2)]
    arrivals: dict[int, list[Request]] = {}
    for i in range(num_requests):
        plen = rng.randint(1, max_prompt)
        shared = rng.randint(0, plen) if rng.random() < 0.6 else 0
        prompt = rng.choice(bases)[:shared] + [rng.randrange(1, vocab) for _ in range(plen - shared)]
        req = Request(
            f"r{i}",
            prompt,
            max_tokens=rng.randint(1, max_out),
            priority=rng.randint(0, 2),
            arrival_time=float(rng.randint(0, 5)),
            eos_token_id=EOS,
            ignore_eos=rng.random() < 0.3,
            block_size=bs,
        )
        arrivals.setdefault(rng.randint(0, 25), []).append(req)
    all_reqs = [r for rs in arrivals.values() for r in rs]
    p_abort = rng.choice([0.0, 0.02, 0.1])
    p_draft = rng.choice([0.0, 0.5, 1.0]) if spec else 0.0

    step = 0
    while step <= max(arrivals) or sched.has_requests():
        assert step < max_steps, f"seed {seed}: no end after {max_steps} steps (livelock?)"
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if sched.running and rng.random() < p_abort:
            res.num_aborted += sched.abort_request(rng.choice(list(sched.requests)))
        if connector is not None:  # the engine loads what the pool promised, before the step
            sched.finish_remote_loads(connector.load(model))
        for req in sched.running:  # the engine proposes drafts for decoding requests
            if rng.random() < p_draft and req.is_decoding:
                truth = true_completion(req.token_ids, 4, vocab, ignore_eos=True)
                req.spec_token_ids = [t if rng.random() < 0.7 else rng.randrange(vocab) for t in truth]
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule()
        check_output(sched, out, running_before, threshold)
        sampled = model.execute(out)
        if out.scheduled_requests and rng.random() < p_abort:  # a client leaves mid-step
            res.num_aborted += sched.abort_request(rng.choice(out.scheduled_requests).request_id)
        for toks in sampled.values():
            res.num_spec_accepted += len(toks) - 1
        live = [r for r in out.sampling_requests if r.status == RequestStatus.RUNNING]
        tokens_before = {r.request_id: r.num_tokens for r in live}
        gained = sched.update_from_output(out, sampled)
        check_gained(gained, live, tokens_before, seed)
        sched.check_invariants()
        step += 1

    res.num_steps = step
    res.num_preemptions = sched.num_preemptions
    res.num_forward_tokens = model.num_forward_tokens
    res.num_remote_tokens = connector.num_loaded if connector is not None else 0
    assert bm.all_blocks_free(), f"seed {seed}: blocks still held at the end"
    for req in all_reqs:
        assert req.is_finished and not req.block_table, req
        if req.status == RequestStatus.FINISHED_ABORTED:
            continue
        res.num_finished += 1
        expected = true_completion(req.prompt_token_ids, req.max_tokens, vocab, req.ignore_eos)
        assert req.completion_token_ids == expected, (
            f"seed {seed}: {req.request_id} produced {req.completion_token_ids}, expected {expected}"
        )
        stopped_on_eos = expected[-1] == EOS and not req.ignore_eos
        assert req.status == (RequestStatus.FINISHED_STOPPED if stopped_on_eos else RequestStatus.FINISHED_LENGTH)
    return res


# ─────────────────────────────────────────────────────────────────────────────────────────────
# Two schedulers side by side: the differential tests of the scheduling exercises
# ─────────────────────────────────────────────────────────────────────────────────────────────


class PlannedConnector:
    """A global KV pool whose answers are drawn up front, per request: so two schedulers asked
    in the same order get the same answers (:class:`FakeConnector` draws as it is asked).

    ``plan[request_id]`` is how many more blocks the pool holds, or ``"wait"``: the first time
    the request is asked about while another load is pending, "ask again next step" (None).
    """

    def __init__(self, plan: dict[str, int | str], block_size: int):
        self.plan = plan
        self.block_size = block_size
        self.pending: dict[str, tuple[Request, int]] = {}
        self.waited: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        planned = self.plan.get(request.request_id, 0)
        if planned == "wait":
            if self.pending and request.request_id not in self.waited:
                self.waited.add(request.request_id)
                return None
            planned = 1
        max_blocks = (request.num_tokens - 1) // self.block_size - num_computed_tokens // self.block_size
        return max(0, min(int(planned), max_blocks)) * self.block_size

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self.pending[request.request_id] = (request, num_external_tokens)

    def request_finished(self, request: Request) -> None:
        self.pending.pop(request.request_id, None)

    def load(self, model: FakeModel, delivered: dict[str, int]) -> dict[str, int]:
        """``delivered[rid]`` of the promised blocks arrive (more is capped to the promise)."""
        loaded = {}
        for rid, (req, promised) in self.pending.items():
            n = min(delivered.get(rid, 0), promised // self.block_size) * self.block_size
            start = req.num_computed_tokens
            for p, slot in zip(range(start, start + n), model.bm.slot_mapping(req, start, start + n)):
                model.kv[slot] = (req.token_ids[p], p)
            loaded[rid] = n
        self.pending = {}
        return loaded


def scheduler_state(sched: Scheduler) -> dict:
    """What two schedulers fed the same workload must agree on after every step."""
    reqs = sorted(sched.requests.values(), key=lambda r: r.request_id)
    return {
        "running": [r.request_id for r in sched.running],
        "waiting": [r.request_id for r in sched.waiting],
        "loading": list(sched.loading),
        "requests (status, computed, cached, blocks, preemptions)": {
            r.request_id: (
                r.status.name,
                r.num_computed_tokens,
                r.num_cached_tokens,
                list(r.block_table),
                r.num_preemptions,
            )
            for r in reqs
        },  # fmt: skip
        "free blocks": list(sched.block_manager.free_block_ids),
        "preemptions": sched.num_preemptions,
    }


def step_summary(out: SchedulerOutput) -> dict:
    """One schedule() call's decisions, as plain values."""
    return {
        "scheduled tokens": {r.request_id: out.num_scheduled_tokens[r.request_id] for r in out.scheduled_requests},
        "first positions": {r.request_id: out.num_computed_tokens[r.request_id] for r in out.scheduled_requests},
        "drafts": dict(out.scheduled_spec_decode_tokens),
        "preempted": [r.request_id for r in out.preempted_requests],
        "admitted": list(out.admitted_request_ids),
        "sampling": sorted(out.sampling_request_ids),
    }


def run_in_lockstep(
    yours: Callable[..., Scheduler],
    book: Callable[..., Scheduler],
    rng: random.Random,
    differential,
    meaning: str,
    *,
    chunked: bool = False,
    max_steps: int = 80,
) -> None:
    """Feed two schedulers one random workload, step by step, and compare them after each.

    ``yours(**kwargs)`` and ``book(**kwargs)`` build the two schedulers, from the same arguments
    and each with its own block manager. ``rng`` draws everything (a ``random.Random``,
    or Hypothesis's): cache size from "one request barely fits" up, budget, ``max_num_seqs``,
    policy, prefix caching, a global pool's answers, prompts sharing prefixes, arrivals, priorities,
    ``max_tokens``, EOS, drafts, aborts; every choice that depends on the state reads the book's.
    After each step ``differential`` (the fixture of exercises/differential.py) compares what the
    step decided on each side, or the exception it raised, and both schedulers' states,
    and fails on the first difference, with the workload so far and ``meaning``.
    """
    from prefix_block_manager import PrefixCachingBlockManager

    vocab, bs = rng.choice([16, 40]), rng.choice([1, 2, 4])
    max_prompt, max_out = rng.randint(1, 20), rng.randint(1, 12)
    longest = max_prompt + max_out - 1
    # Tight caches and several requests at once: preemption, a waiting queue, a head that does not
    # fit while a smaller request behind it would are what the scheduling rules are about.
    num_blocks = cdiv(longest, bs) + rng.choice([0, 1, 2, 4, 10])
    # Without chunking a request's prompt plus max_tokens - 1 must fit the budget: drawn below to fit.
    budget = rng.randint(1, 2 * longest) if chunked else rng.randint(max_prompt, 2 * longest)
    prefix_caching, remote = rng.random() < 0.5, rng.random() < 0.3
    params = dict(
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=budget,
        num_gpu_blocks=num_blocks,
        policy=rng.choice(["fcfs", "priority"]),
        block_size=bs,
    )
    if chunked:
        params["long_prefill_token_threshold"] = rng.choice([None, rng.randint(1, 8)])
    base = [rng.randrange(1, vocab) for _ in range(max_prompt)]
    specs = []
    for i in range(rng.randint(2, 8)):
        n = rng.randint(1, max_prompt)
        shared = rng.randint(0, n) if rng.random() < 0.6 else 0
        prompt = base[:shared] + [rng.randrange(1, vocab) for _ in range(n - shared)]
        max_tokens = rng.randint(1, max_out if chunked else min(max_out, budget - n + 1))
        specs.append((f"r{i}", prompt, max_tokens, rng.randint(0, 3), float(rng.randint(0, 3)),
                      rng.random() < 0.3, rng.choice([0, 0, 1, rng.randint(0, 8)])))  # fmt: skip
    answers: list[int | str] = [0, 0, 1, 2, "wait"]
    plan = {str(s[0]): rng.choice(answers) for s in specs}
    sides: list[dict] = []
    for _ in range(2):
        bm = (PrefixCachingBlockManager if prefix_caching else BlockManager)(num_blocks, bs)
        connector = PlannedConnector(plan, bs) if remote else None
        sides.append(dict(bm=bm, connector=connector, model=FakeModel(bm, vocab), requests={}))
    for side, make in zip(sides, (yours, book)):
        side["sched"] = make(**params, block_manager=side["bm"], kv_connector=side["connector"])
    history = [f"{'chunked ' if chunked else ''}scheduler {params}, prefix caching {prefix_caching}, pool {remote}"]
    p_abort, p_draft = rng.choice([0.0, 0.05, 0.15]), rng.choice([0.0, 0.5])

    def step(side: dict, arrivals: list, abort: str | None, drafts: dict, delivered: dict, late_abort: str | None):
        sched, model = side["sched"], side["model"]
        for rid, prompt, max_tokens, priority, arrival, ignore_eos, _ in arrivals:
            req = Request(rid, prompt, max_tokens=max_tokens, priority=priority, arrival_time=arrival,
                          eos_token_id=EOS, ignore_eos=ignore_eos, block_size=bs)  # fmt: skip
            side["requests"][rid] = req
            sched.add_request(req)
        if abort is not None:
            sched.abort_request(abort)
        if side["connector"] is not None:
            sched.finish_remote_loads(side["connector"].load(model, delivered))
        for rid, tokens in drafts.items():
            side["requests"][rid].spec_token_ids = list(tokens)
        out = sched.schedule()
        summary = step_summary(out)
        sampled = model.execute(out)
        if late_abort is not None:
            sched.abort_request(late_abort)
        finished = sched.update_from_output(out, sampled)
        sched.check_invariants()
        summary["finished"] = sorted(r.request_id for r in finished)
        return summary

    step_no = 0
    reference = sides[1]["sched"]
    while step_no <= max(s[6] for s in specs) or reference.has_requests():
        if step_no >= max_steps:
            break
        arrivals = [s for s in specs if s[6] == step_no]
        abort = rng.choice(sorted(reference.requests)) if reference.requests and rng.random() < p_abort else None
        drafts = {}
        for req in reference.running:
            if rng.random() < p_draft and req.is_decoding:
                truth = true_completion(req.token_ids, 3, vocab, ignore_eos=True)
                drafts[req.request_id] = [t if rng.random() < 0.7 else rng.randrange(vocab) for t in truth]
        pending = sides[1]["connector"].pending if remote else {}
        delivered = {rid: rng.randint(0, promised // bs) for rid, (_, promised) in sorted(pending.items())}
        late_abort = rng.choice(sorted(reference.requests)) if reference.requests and rng.random() < p_abort else None
        history.append(
            f"step {step_no}: arrive {[a[0] for a in arrivals]}, abort {abort}, drafts {drafts}, "
            f"pool delivers {delivered}, abort after schedule {late_abort}"
        )
        outcomes = [differential.call(step, side, arrivals, abort, drafts, delivered, late_abort) for side in sides]
        differential.agree(
            "\n  ".join(history[:1] + history[-4:]),
            *outcomes,
            meaning=meaning,
            state=(scheduler_state(sides[0]["sched"]), scheduler_state(reference)),
        )
        if outcomes[1].error is not None:
            raise outcomes[1].error
        step_no += 1
