"""The two-phase scheduler of vLLM V1, rebuilt: who runs this step, and with how many tokens.

Every step the engine asks :meth:`Scheduler.schedule` for a batch, runs one forward over it and
hands the sampled tokens back to :meth:`Scheduler.update_from_output`. The scheduler works at the
level of *tokens*: each request carries ``num_computed_tokens`` (tokens whose K/V is already in
the cache, chapter 01) and a step gives it ``num_tokens - num_computed_tokens`` more tokens — a
whole prompt, one decode token, or a decode token plus speculative draft tokens (chapter 05).

Two phases, under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``):

1. **Running requests first**, in order. A request that cannot get KV blocks preempts another
   one (FCFS: the newest running request; priority: the least important, latest arrival) until
   it fits or is itself the victim. Preemption is *recompute*: the victim returns its blocks,
   restarts from ``num_computed_tokens = 0`` at the head of the waiting queue, and on its way
   back in usually finds its prompt in the prefix cache (chapter 03).
2. **Then waiting requests**, only if nothing was preempted this step (admitting a new request
   right after taking blocks from a running one would just preempt it again). A waiting request
   is admitted when its prefix-cache hits plus its new tokens get blocks.

With a global KV pool (``kv_connector``, chapter 07's connector on chapter 03's pool), a waiting
request whose prompt the pool holds beyond the local hits takes its blocks and waits in
``WAITING_FOR_REMOTE_KVS`` while the engine loads that K/V; then it runs like any other.

Without chunked prefill (this chapter) a waiting request is admitted only if its whole remaining
prompt fits the remaining budget; chapter 06's ``ChunkedPrefillScheduler`` overrides one method,
:meth:`Scheduler._num_new_tokens`, to cut prompts into chunks instead.

``scheduler_testing.py`` drives it through thousands of random steps against a fake model and
checks every step; the README lists what this version fixes in the sketch it started from.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from block_manager import BlockManager, cdiv
from sequence import Sequence


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every ``FINISHED_*`` status is final."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # blocks allocated, K/V being loaded from a global pool (chapter 07)
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # a stop token (EOS), or a stop string (the engine calls finish_request)
    FINISHED_LENGTH = 5  # max_tokens reached
    FINISHED_ABORTED = 6  # the client went away
    FINISHED_ERROR = 7  # the engine could not go on with it (vLLM's finish reason "error")
    FINISHED_LENGTH_CAPPED = 5  # the README listing's name for FINISHED_LENGTH (same member)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


class Request(Sequence):
    """A generation request: chapter 01's :class:`Sequence` plus status, priority and stop rules.

    Args:
        request_id: unique name of the request.
        prompt_token_ids: the prompt (``token_ids=`` is accepted as another spelling).
        max_tokens: most tokens to generate, at least 1; 16 when omitted (``max_new_tokens=``
            is accepted as another spelling).
        priority: with ``policy="priority"``, *lower values are served first* (vLLM's
            convention; 0 is the default and the most common value).
        arrival_time: seconds (``time.time()`` when omitted); orders requests of equal priority.
        eos_token_id: token id, or several, that end the request (``None``: none).
        ignore_eos: keep generating past ``eos_token_id`` (benchmarks use it to fix the length).
        stop_token_ids: more token ids that end the request, even with ``ignore_eos``.
        block_size, cache_salt: passed to :class:`Sequence`.

    ``stop_token_ids`` (after construction) is the one set the scheduler checks: EOS unless
    ignored, plus the extra stop tokens. ``spec_token_ids`` holds the draft tokens proposed for
    the next step (chapter 05); the engine sets it before :meth:`Scheduler.schedule` and the
    scheduler clears it once they are verified. ``num_cached_tokens`` is set when the request is
    first admitted: the prompt tokens it did not have to compute (a later re-admission after a
    preemption re-hits blocks it computed itself, which is no saving to report).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int] | None = None,
        max_tokens: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Iterable[int] = (),
        block_size: int = 16,
        cache_salt: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        max_new_tokens: int | None = None,
    ):
        prompt_token_ids = _one_of("prompt_token_ids", prompt_token_ids, "token_ids", token_ids)
        max_tokens = _one_of("max_tokens", max_tokens, "max_new_tokens", max_new_tokens)
        max_tokens = 16 if max_tokens is None else max_tokens
        if prompt_token_ids is None:
            raise ValueError("prompt_token_ids is required")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        super().__init__(prompt_token_ids, block_size=block_size, cache_salt=cache_salt)
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        eos = (
            ()
            if eos_token_id is None or ignore_eos
            else ((eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id))
        )
        stop = frozenset(stop_token_ids)
        # A frozenset that already holds EOS is kept as it is: the engine's n completions of one
        # request share one set, however many stop ids a client sent.
        self.stop_token_ids: frozenset[int] = stop if stop.issuperset(eos) else stop | frozenset(eos)
        self.ignore_eos = ignore_eos
        self.status = RequestStatus.WAITING
        self.spec_token_ids: list[int] = []
        self.num_preemptions = 0

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def is_decoding(self) -> bool:
        """Past its prompt, with only its last sampled token (plus any drafts) left to feed."""
        return self.num_computed_tokens == self.num_tokens - 1 and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.completion_token_ids

    @property
    def max_num_kv_tokens(self) -> int:
        """Most tokens this request ever holds K/V for: the final sampled token is never fed."""
        return self.num_prompt_tokens + self.max_tokens - 1

    # The README listing's spellings of the same facts.
    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens

    @property
    def seq_len(self) -> int:
        return self.num_tokens

    @property
    def remaining_tokens(self) -> int:
        """Known tokens whose K/V is not in the cache yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_blocks_needed(self) -> int:
        return self.num_blocks


def _one_of(name: str, value, other_name: str, other_value):
    if value is not None and other_value is not None:
        raise ValueError(f"pass {name} or {other_name}, not both")
    return value if other_value is None else other_value


class KVConnector(Protocol):
    """The scheduler side of a global KV pool (vLLM's ``KVConnectorBase_V1`` names).

    The engine's connector (chapter 07, on chapter 03's pool) implements it; the scheduler only
    asks and tells, it never moves K/V.
    """

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Prompt tokens past ``num_computed_tokens`` (the local hits) the pool holds, in whole
        blocks, never the last prompt token; ``None`` for "ask again next step" (another request
        is already loading blocks this one needs, which will then be local hits)."""

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """``request``'s blocks are allocated: remember to load those tokens into them."""

    def request_finished(self, request: Request) -> None:
        """``request`` ended (finished, aborted): forget its pending work."""


@dataclass
class SchedulerOutput:
    """What one step runs: the batch, in the order the forward must process it.

    ``num_computed_tokens[rid]`` is the request's first position this step (tokens before it are
    already in the KV cache, prefix hits included); the step feeds positions
    ``[start, start + num_scheduled_tokens[rid])``: the request's known tokens from ``start``,
    then its ``scheduled_spec_decode_tokens``. A request *samples* this step when those positions
    reach the end of its known tokens (:meth:`produces_token`); a prompt chunk that stops short
    samples nothing. The per-request methods read the requests' token lists, so they hold
    between ``schedule()`` and ``update_from_output()``, the window in which the model runs.
    """

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_requests: list[Request] = field(default_factory=list)
    admitted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    sampling_request_ids: set[str] = field(default_factory=set)
    token_budget: int = 0
    kv_connector_metadata: Any = None  # opaque here: what a global KV pool's workers do this step

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    total_tokens = total_num_scheduled_tokens  # the README listing's name

    def is_empty(self) -> bool:
        return not self.scheduled_requests

    def produces_token(self, request: Request | str) -> bool:
        rid = request if isinstance(request, str) else request.request_id
        return rid in self.sampling_request_ids

    @property
    def sampling_requests(self) -> list[Request]:
        """Scheduled requests that sample at least one token this step, in batch order."""
        return [r for r in self.scheduled_requests if r.request_id in self.sampling_request_ids]

    def input_token_ids(self, request: Request) -> list[int]:
        """The token ids this step feeds for ``request`` (its known tokens, then its drafts)."""
        rid = request.request_id
        start = self.num_computed_tokens[rid]
        spec = self.scheduled_spec_decode_tokens.get(rid, [])
        end = start + self.num_scheduled_tokens[rid] - len(spec)
        return request.token_ids[start:end] + spec


@dataclass
class EngineCoreOutput:
    """What one step gave one request that sampled (vLLM V1's ``EngineCoreOutput``), as
    :meth:`Scheduler.update_from_output` returns it.

    ``new_token_ids`` joined the request this step: one sampled token, or the accepted drafts and
    one more, cut after a token that ended it. ``finish_reason`` is the ``FINISHED_*`` status it
    ended with in this step (a stop token, or ``max_tokens``), None while it runs.
    ``num_cached_tokens`` is :class:`Request`'s: the prompt tokens it found in the prefix cache.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: RequestStatus | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class FCFSQueue:
    """The waiting queue of ``policy="fcfs"``: arrival order; preempted requests jump the line."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_preempted(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """The waiting queue of ``policy="priority"``: a heap on (priority, arrival_time).

    A preempted request keeps its arrival time, so it goes back in ahead of everything of its
    priority that arrived after it. Requests equal on both keys leave in the order they came in.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._insertions = itertools.count()  # the heap's tie-break: Requests do not compare

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._insertions), req))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


class Scheduler:
    """vLLM V1's scheduler without chunked prefill: running requests first, then waiting ones.

    Args:
        max_num_seqs: most requests in the running set (and so in one batch).
        max_num_batched_tokens: the token budget of one step.
        num_gpu_blocks: KV blocks of the default block manager.
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (lower ``priority`` value first).
        block_size: tokens per KV block; every request must use the same.
        block_manager: a chapter 01 :class:`BlockManager` or a subclass (chapter 03's
            ``PrefixCachingBlockManager``); by default ``BlockManager(num_gpu_blocks, block_size)``.
        kv_connector: optional, a global KV pool's scheduler side (:class:`KVConnector`): at
            admission, after the local prefix hits, it says how many more prompt tokens the
            pool holds; the request then waits in ``WAITING_FOR_REMOTE_KVS``, holding its
            blocks, until :meth:`finish_remote_loads` says how many arrived.

    The defaults size a small example (``Scheduler(policy="priority")`` runs as is).
    """

    chunked_prefill = False

    def __init__(
        self,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        num_gpu_blocks: int = 1000,
        policy: str = "fcfs",
        block_size: int = 16,
        block_manager: BlockManager | None = None,
        kv_connector: KVConnector | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        if block_manager is None:
            block_manager = BlockManager(num_gpu_blocks, block_size)
        elif block_manager.block_size != block_size:
            raise ValueError(f"block_size={block_size} differs from the block manager's {block_manager.block_size}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.block_size = block_size
        self.block_manager = block_manager
        self.waiting: FCFSQueue | PriorityQueue = FCFSQueue() if policy == "fcfs" else PriorityQueue()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS, in admission order
        self.kv_connector = kv_connector
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_steps = 0
        self.num_draft_tokens = 0  # speculative tokens scheduled for verification
        self.num_accepted_tokens = 0  # of those, accepted by the target

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a new request; raises ValueError if it could never be scheduled."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.block_table:
            raise ValueError(f"request {request.request_id!r} is not a fresh request")
        if request.block_size != self.block_size:
            raise ValueError(f"request block_size={request.block_size} differs from the scheduler's {self.block_size}")
        self.check_schedulable(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_schedulable(self, request: Request) -> None:
        """Raise ValueError if ``request`` could never run to its end under this scheduler.

        ``add_request`` calls it; an engine calls it too, to refuse a bad request before it
        queues any of a batch.
        """
        self._check_fits_in_cache(request)
        # Without chunking a prompt goes through in one step, and so does the recompute of a
        # preempted request (its prompt plus everything it generated): both must fit the budget.
        if request.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}; enable chunked prefill (chapter 06) or raise it"
            )
        if request.max_num_kv_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) - 1 "
                f"exceeds max_num_batched_tokens={self.max_num_batched_tokens}: after a "
                "preemption it could not be recomputed in one step; lower max_tokens, raise the "
                "budget, or enable chunked prefill (chapter 06)"
            )

    def _check_fits_in_cache(self, request: Request) -> None:
        # A request that alone does not fit in the cache would, once it ran out of blocks,
        # preempt everything and then itself, forever: refuse it up front.
        blocks = cdiv(request.max_num_kv_tokens, self.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) "
                f"needs {blocks} KV blocks but the cache has {self.block_manager.num_blocks}"
            )

    def has_requests(self) -> bool:
        return bool(self.waiting) or bool(self.running) or bool(self.loading)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a live request with a final ``status``, wherever it is; its blocks go back.

        Returns False (and does nothing) for an unknown or already finished request, so a
        client that disconnects after its request finished is harmless.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a FINISHED_* status, got {status!r}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.loading[request_id]
        else:
            self.waiting.remove(req)
        self._finish(req, status)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; returns whether there was one to abort."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.spec_token_ids = []
        if self.kv_connector is not None:
            self.kv_connector.request_finished(req)
        self.block_manager.free(req)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)
        self.num_finished += 1

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch and reserve its KV slots."""
        out = self._new_output()
        budget = self.max_num_batched_tokens
        scheduled_running, budget = self._schedule_running(out, budget)
        scheduled_new: list[Request] = []
        # Admitting a request right after taking blocks from a running one would only set up
        # the next preemption.
        if not out.preempted_requests:
            scheduled_new, budget = self._schedule_waiting(out, budget)
        out.scheduled_requests = scheduled_running + scheduled_new
        out.admitted_request_ids = [r.request_id for r in scheduled_new]
        self.num_steps += 1
        return out

    def _new_output(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self.finished_req_ids, token_budget=self.max_num_batched_tokens)
        self.finished_req_ids = set()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[list[Request], int]:
        """Phase 1: give running requests their tokens, preempting others when blocks run out."""
        scheduled: list[Request] = []
        for req in self._running_order():
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if num_new == 0:
                continue
            while not self.block_manager.allocate_slots(req, num_new):
                victim = self._select_victim()
                if victim in scheduled:  # it gives back the tokens it was given this step
                    scheduled.remove(victim)
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                    out.num_computed_tokens.pop(victim.request_id)
                    out.scheduled_spec_decode_tokens.pop(victim.request_id, None)
                    out.sampling_request_ids.discard(victim.request_id)
                self._preempt(victim)
                out.preempted_requests.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(req)
                self._record(out, req, num_new)
                budget -= num_new
        return scheduled, budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> tuple[list[Request], int]:
        """Phase 2: admit waiting (new or preempted) requests, in queue order, while they fit."""
        scheduled: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            req = self.waiting.peek()
            remote = self._start_remote_load(req)
            if remote is None:
                break  # the head waits one step for a load it shares, then hits the local cache
            if remote:
                continue
            num_new = self._admit(req, budget)
            if num_new == 0:
                break  # the head of the queue waits; nothing may overtake it
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
            self._record(out, req, num_new)
            budget -= num_new
        return scheduled, budget

    def _running_order(self) -> list[Request]:
        """The order phase 1 visits running requests in (a snapshot: preemption edits the list)."""
        return list(self.running)

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens (drafts included) to give ``req`` this step, from position ``num_computed``.

        0 leaves the request out. Without chunking it is all of the request's uncomputed tokens
        or nothing. Draft tokens are an extra: trimmed to the budget and to what ``max_tokens``
        can still use.
        """
        num_new = req.num_tokens - num_computed
        if num_new > budget:
            return 0
        return num_new + self._num_spec_tokens(req, num_computed, num_new, budget - num_new)

    def _num_spec_tokens(self, req: Request, num_computed: int, num_new: int, budget: int) -> int:
        # Drafts only ride on a decode step that feeds the last sampled token.
        if not req.spec_token_ids or not req.is_decoding or num_computed + num_new != req.num_tokens:
            return 0
        still_useful = req.max_tokens - req.num_completion_tokens - 1
        return max(0, min(len(req.spec_token_ids), budget, still_useful))

    def _admit(self, req: Request, budget: int) -> int:
        """Try to start ``req``: attach its prefix-cache hits and the slots of its first tokens."""
        computed = self.block_manager.get_computed_blocks(req)
        num_hit_tokens = len(computed) * self.block_size
        num_new = self._num_new_tokens(req, num_hit_tokens, budget)
        if num_new == 0 or not self.block_manager.allocate_slots(req, num_new, computed):
            return 0
        req.num_computed_tokens = num_hit_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit_tokens
        return num_new

    # ------------------------------------------------------------------ a global KV pool
    def _start_remote_load(self, req: Request) -> bool | None:
        """If the connector holds more of ``req``'s prompt than the local cache, take its blocks
        now and park it in ``WAITING_FOR_REMOTE_KVS`` until the K/V has arrived (True); False
        when it does not; None when the connector asks the request to wait a step."""
        if self.kv_connector is None:
            return False
        computed = self.block_manager.get_computed_blocks(req)
        num_hit_tokens = len(computed) * self.block_size
        num_external = self.kv_connector.get_num_new_matched_tokens(req, num_hit_tokens)
        if num_external is None:
            return None
        if num_external <= 0 or not self.block_manager.allocate_slots(req, num_external, computed):
            return False
        self.waiting.pop()
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = req
        self.kv_connector.update_state_after_alloc(req, num_external)
        return True

    def finish_remote_loads(self, num_loaded_tokens: dict[str, int]) -> None:
        """The pool's K/V arrived: ``num_loaded_tokens[rid]`` tokens (block-aligned, possibly fewer
        than promised: what failed to load is computed instead). The request starts running."""
        for rid, num_loaded in num_loaded_tokens.items():
            req = self.loading.pop(rid, None)
            if req is None:
                continue  # aborted while its K/V was on the way
            req.num_computed_tokens += num_loaded
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            self.block_manager.cache_full_blocks(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _record(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        rid = req.request_id
        out.num_scheduled_tokens[rid] = num_new
        out.num_computed_tokens[rid] = req.num_computed_tokens
        num_known = num_new
        if req.num_computed_tokens + num_new > req.num_tokens:
            num_spec = req.num_computed_tokens + num_new - req.num_tokens
            out.scheduled_spec_decode_tokens[rid] = req.spec_token_ids[:num_spec]
            num_known -= num_spec
        if req.num_computed_tokens + num_known == req.num_tokens:
            out.sampling_request_ids.add(rid)

    # ------------------------------------------------------------------ preemption
    def _select_victim(self) -> Request:
        if self.policy == "priority":
            # Lower value = more important, so the victim is the largest (priority, arrival);
            # scanning from the end makes the latest admitted win a tie.
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # FCFS: the most recently admitted

    def preempt_running(self) -> None:
        """Preempt every running request, the latest admitted first: each frees its blocks and
        waits to be recomputed (a cache that must be emptied while requests run)."""
        for req in reversed(list(self.running)):
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)

    # ------------------------------------------------------------------ after the forward
    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, list[int]]
    ) -> list[EngineCoreOutput]:
        """Fold one forward's results back in; returns what each request that sampled gained.

        ``sampled_token_ids[rid]`` lists the tokens a sampling request produced: its accepted
        draft tokens then one more (so ``len - 1`` of its ``k`` drafts were accepted). Requests
        that sampled nothing (a prompt chunk) may be missing or map to an empty list. Each
        :class:`EngineCoreOutput` holds the tokens that joined its request (a stop among the
        accepted drafts drops those after it) and, if the request ended here, its final status.
        """
        outputs: list[EngineCoreOutput] = []
        for req in output.scheduled_requests:
            rid = req.request_id
            if self.requests.get(rid) is not req or req.status != RequestStatus.RUNNING:
                continue  # finished or aborted between schedule() and now
            num_computed = req.num_computed_tokens + output.num_scheduled_tokens[rid]
            new_token_ids: list[int] | None = None  # None: a prompt chunk that samples nothing
            status = None
            if output.produces_token(rid):
                sampled = sampled_token_ids.get(rid) or []
                num_spec = len(output.scheduled_spec_decode_tokens.get(rid, ()))
                if not 1 <= len(sampled) <= num_spec + 1:
                    raise ValueError(
                        f"sampled_token_ids[{rid!r}] must hold 1 to {num_spec + 1} tokens, got {sampled!r}"
                    )
                num_computed -= num_spec - (len(sampled) - 1)  # rejected drafts are recomputed
                self.num_draft_tokens += num_spec
                self.num_accepted_tokens += len(sampled) - 1
                new_token_ids, status = self._append_tokens(req, sampled)
            req.spec_token_ids = []
            if status is not None:
                # A stop among the accepted drafts drops the tokens after it, and their K/V.
                num_computed = min(num_computed, req.num_tokens - 1)
            req.num_computed_tokens = num_computed
            self.block_manager.cache_full_blocks(req)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            if new_token_ids is not None:
                outputs.append(EngineCoreOutput(rid, new_token_ids, status, req.num_cached_tokens))
        return outputs

    def _append_tokens(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append ``tokens`` up to the first that ends ``req``; the tokens appended and the
        status they ended it with (None: it goes on)."""
        for i, t in enumerate(tokens):
            req.append_token(t)
            if t in req.stop_token_ids:
                return tokens[: i + 1], RequestStatus.FINISHED_STOPPED
            if req.num_completion_tokens >= req.max_tokens:
                return tokens[: i + 1], RequestStatus.FINISHED_LENGTH
        return tokens, None

    # ------------------------------------------------------------------ observation
    def get_stats(self) -> dict:
        """Counters for logs and the server's ``/metrics``."""
        bm = self.block_manager
        stats = {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "num_finished": self.num_finished,
            "num_steps": self.num_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "kv_cache_usage": bm.usage,
            "num_free_blocks": bm.get_num_free_blocks(),
        }
        for name in ("prefix_cache_queries", "prefix_cache_hits"):
            if hasattr(bm, name):
                stats[name] = getattr(bm, name)
        return stats

    def check_invariants(self) -> None:
        """Assert the queues and the block accounting agree (tests call it after every step)."""
        self.block_manager.check_invariants()
        waiting = list(self.waiting)
        ids = [r.request_id for r in waiting] + [r.request_id for r in self.running] + list(self.loading)
        assert len(ids) == len(set(ids)), f"a request is queued twice: {ids}"
        assert set(ids) == set(self.requests), "a live request is in no queue (or a dead one in one)"
        assert len(self.running) + len(self.loading) <= self.max_num_seqs
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert not r.block_table and r.num_computed_tokens == 0, r
        holders: dict[int, int] = {}
        for r in self.running + list(self.loading.values()):
            expected = RequestStatus.RUNNING if r in self.running else RequestStatus.WAITING_FOR_REMOTE_KVS
            assert r.status == expected, r
            assert r.num_computed_tokens < r.num_tokens, r
            assert len(r.block_table) * self.block_size >= r.num_computed_tokens, r
            for b in r.block_table:
                holders[b] = holders.get(b, 0) + 1
        for block in self.block_manager.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), block
