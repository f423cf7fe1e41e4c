"""The step trace: one JSON line per engine step, read off the engine's own objects.

:class:`StepTracer` builds each record from what the step already holds (the ``SchedulerOutput``,
the sampled tokens, the block manager, the scheduler's queues) and hands it to its sinks: a JSON
lines file, the server's live ``/viz``. :func:`read_trace` and :func:`check_trace` read a trace
back. The format, every field and the invariants: ``docs/step_trace.md``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from block_manager import BlockManager
from scheduler import Request, Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from vllm_from_scratch.config import EngineConfig
    from vllm_from_scratch.kv_connector import KVConnectorScheduler
    from vllm_from_scratch.output_processor import OutputProcessorOutput

SCHEMA = 1
"""Version of the record format; bumped when a field changes meaning or disappears."""

Record = dict[str, Any]
Sink = Callable[[Record], None]

# The settings copied into the header: the ones that change what a step does.
_HEADER_SETTINGS = (
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "scheduling_policy",
    "long_prefill_token_threshold",
    "speculative_config",
    "max_model_len",
    "tensor_parallel_size",
    "attention_backend",
)


def work_kind(start: int, num_known: int, num_drafts: int, samples: bool, num_prompt_tokens: int) -> str:
    """A scheduled slice's ``kind``: ``"verify"``, ``"decode"`` or ``"prefill"`` (docs/step_trace.md)."""
    if num_drafts:
        return "verify"
    if samples and num_known == 1 and start >= num_prompt_tokens:
        return "decode"
    return "prefill"


class TracedEngine(Protocol):
    """What a :class:`StepTracer` reads of its engine (``LLMEngine``'s parts)."""

    config: EngineConfig
    block_manager: BlockManager
    scheduler: Scheduler
    kv_connector: KVConnectorScheduler | None


class StepTracer:
    """Builds one record per engine step and hands it to every sink.

    Args:
        engine: the engine to watch (read only): ``LLMEngine``, or anything with its
            :class:`TracedEngine` parts.
        path: a JSON lines file to write; None for a tracer fed only to sinks added later (the
            server's /viz). With no sink a step costs one call that returns at once.
    """

    def __init__(self, engine: TracedEngine, path: str | os.PathLike | None = None):
        self.engine = engine
        self._sinks: tuple[Sink, ...] = ()
        self._t0 = time.perf_counter()
        self._unix_t0 = time.time()
        self._step = 0
        self._known: set[str] = set()
        self._pending_aborts: list[Any] = []
        self._hashed: dict[int, Any] | None = None  # block id -> hash at the last record
        self._parked: dict[str, int] = {}  # loading from a global pool: computed tokens when parked
        self._running_before: set[str] = set()
        self._loaded_blocks: int | None = 0  # the pool connector's loaded_blocks at the last record
        self._file: TextIO | None = None
        if path is not None:
            self._file = open(path, "w", encoding="utf-8")
            self._write(self.header())
            self.add_sink(self._write)

    # ------------------------------------------------------------------ sinks
    def add_sink(self, sink: Sink) -> None:
        """Call ``sink(record)`` for every later record (from the engine's thread)."""
        self._sinks = (*self._sinks, sink)  # a new tuple: the engine thread iterates the old one

    def remove_sink(self, sink: Sink) -> None:
        """Stop calling ``sink``."""
        self._sinks = tuple(s for s in self._sinks if s is not sink)

    def _write(self, record: Record) -> None:
        assert self._file is not None, "only added as a sink when there is a file"
        # One flush per step keeps a killed run's trace readable up to its last step.
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def _emit(self, record: Record) -> None:
        for sink in self._sinks:
            sink(record)

    # ------------------------------------------------------------------ what the engine calls
    def header(self) -> Record:
        """The first line: the model, the pool, the budget and the settings of every step."""
        cfg = self.engine.config
        settings = {name: getattr(cfg, name, None) for name in _HEADER_SETTINGS}
        settings["dtype"] = str(cfg.torch_dtype).removeprefix("torch.")
        settings["device"] = str(cfg.torch_device)
        bm = self.engine.block_manager
        return {
            "type": "header",
            "schema": SCHEMA,
            "model": Path(cfg.model_dir).name,
            "num_blocks": bm.num_blocks,
            "block_size": bm.block_size,
            "token_budget": cfg.max_num_batched_tokens,
            "max_num_seqs": cfg.max_num_seqs,
            "unix_time": self._unix_t0,
            "settings": settings,
        }

    def on_step(
        self,
        sched: SchedulerOutput,
        sampled: dict[str, list[int]],
        outputs: OutputProcessorOutput,
        start: float,
        duration: float,
    ) -> None:
        """Record the step that ran ``sched`` (a non-empty SchedulerOutput), sampled ``sampled``
        and reported ``outputs`` (the output processor's, by the scheduler's request ids);
        ``start`` is its ``time.perf_counter()``."""
        step = self._step
        self._step += 1
        if not self._sinks:
            # Unwatched steps: the next record cannot attribute evictions or loads to a step.
            self._hashed = self._loaded_blocks = None
            return
        scheduled = [self._scheduled(sched, r, sampled) for r in sched.scheduled_requests]
        used = {
            kind: sum(s["tokens"] for s in scheduled if s["kind"] == kind) for kind in ("prefill", "decode", "verify")
        }
        record: Record = {
            **self._record("step", step, start),
            "duration": round(duration, 6),
            "budget": {"total": sched.token_budget, "used": sum(used.values()), **used},
            "scheduled": scheduled,
            "admitted": list(sched.admitted_request_ids),
            "prefix_hits": {rid: n for rid in sched.admitted_request_ids if (n := sched.num_computed_tokens.get(rid))},
            "preempted": [r.request_id for r in sched.preempted_requests],
        }
        record.update(self._outputs(outputs))
        record.update(self._snapshot(extra_new=sched.scheduled_requests))
        if (pool := self._pool(sched)) is not None:
            record["pool"] = pool
        self._known.difference_update(f["id"] for f in record["finished"])
        self._emit(record)

    def record_abort(self, request: Request) -> None:
        """``request`` was aborted between steps; the next record lists it under ``aborted``."""
        if self._sinks:
            self._pending_aborts.append(request)

    def close(self) -> None:
        """Write the ``end`` record (aborts since the last step, the final pool) and close the file."""
        if self._sinks:
            self._emit({**self._record("end", self._step, time.perf_counter()), **self._snapshot()})
        self._sinks = ()
        if self._file is not None:
            self._file.close()
            self._file = None

    # ------------------------------------------------------------------ parts of a record
    def _record(self, kind: str, step: int, start: float) -> Record:
        """The fields every step and end record opens with; ``start`` is a ``time.perf_counter()``."""
        return {"type": kind, "schema": SCHEMA, "step": step, "t": round(start - self._t0, 6)}

    def _scheduled(self, sched: SchedulerOutput, req: Request, sampled: dict[str, list[int]]) -> Record:
        rid = req.request_id
        start, num_tokens = sched.num_computed_tokens[rid], sched.num_scheduled_tokens[rid]
        drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
        samples = sched.produces_token(rid)
        tokens = list(sampled.get(rid) or []) if samples else []
        return {
            "id": rid,
            "kind": work_kind(start, num_tokens - len(drafts), len(drafts), samples, req.num_prompt_tokens),
            "tokens": num_tokens,
            "start": start,
            "computed": req.num_computed_tokens,
            "drafts": len(drafts),
            "accepted": max(len(tokens) - 1, 0) if drafts else 0,
            "sampled": tokens,
        }

    @staticmethod
    def _outputs(outputs: OutputProcessorOutput) -> Record:
        """Text increments and the requests that finished (aborts are recorded apart)."""
        aborted = {rid for rid, c in outputs.finished.items() if c.finish_reason == "abort"}
        finished = [
            {"id": rid, "reason": c.finish_reason, "completion_tokens": len(c.token_ids), "text": c.text}
            for rid, c in outputs.finished.items()
            if rid not in aborted
        ]
        return {"finished": finished, "text": {rid: t for rid, t in outputs.new_text.items() if rid not in aborted}}

    def _snapshot(self, extra_new: Iterable = ()) -> Record:
        """The state the next step starts from: queues, block tables, the block pool."""
        scheduler = self.engine.scheduler
        waiting = list(scheduler.waiting)
        running = list(scheduler.running)
        loading = list(scheduler.loading.values())  # a global KV pool's loads
        aborted, self._pending_aborts = self._pending_aborts, []
        live = waiting + loading + running
        record: Record = {
            "new": self._new_requests([*live, *extra_new, *aborted]),
            "aborted": [r.request_id for r in aborted],
            "waiting": [
                {"id": r.request_id, "priority": r.priority, "preempted": r.num_preemptions > 0} for r in waiting
            ],
            "loading": [r.request_id for r in loading],
            "running": [{"id": r.request_id, "priority": r.priority} for r in running],
            "requests": {
                r.request_id: {
                    "status": r.status.name.lower(),
                    "tokens": r.num_tokens,
                    "computed": r.num_computed_tokens,
                    "blocks": list(r.block_table),
                }
                for r in live
            },
            "blocks": self._blocks(),
        }
        self._known.difference_update(record["aborted"])
        return record

    def _pool(self, sched: SchedulerOutput) -> Record | None:
        """With a global KV pool (``engine.kv_connector``): the tokens each request loaded from
        it, the blocks each offers to it after this forward (the step's ``kv_connector_metadata``),
        and the connector's running totals.

        A load is the leap of ``num_computed_tokens`` of a request that left
        ``WAITING_FOR_REMOTE_KVS``. A request parked during a step that ran nothing (no record saw
        it) is known by elimination: scheduled, not admitted, not running before; it gets what the
        totals say arrived, when it is the only one."""
        connector = self.engine.kv_connector
        if connector is None:
            return None
        scheduler = self.engine.scheduler
        totals = dict(vars(connector.stats))
        loaded = {}
        for rid, parked_at in self._parked.items():
            if rid in sched.num_computed_tokens:
                loaded[rid] = sched.num_computed_tokens[rid] - parked_at
            elif rid in scheduler.requests and rid not in scheduler.loading:
                loaded[rid] = scheduler.requests[rid].num_computed_tokens - parked_at
        unseen = [
            rid
            for rid in sched.num_computed_tokens
            if rid not in sched.admitted_request_ids and rid not in self._running_before and rid not in self._parked
        ]
        if self._loaded_blocks is not None and len(unseen) == 1:
            arrived = (totals["loaded_blocks"] - self._loaded_blocks) * self.engine.block_manager.block_size
            remaining = arrived - sum(loaded.values())
            if remaining > 0:
                loaded[unseen[0]] = remaining
        self._parked = {rid: r.num_computed_tokens for rid, r in scheduler.loading.items()}
        self._loaded_blocks = totals["loaded_blocks"]
        self._running_before = {r.request_id for r in scheduler.running}
        saves = getattr(sched.kv_connector_metadata, "saves", [])
        return {"loaded": loaded, "published": {t.request_id: len(t.block_ids) for t in saves}, "totals": totals}

    def _new_requests(self, requests: Iterable[Request]) -> list[Record]:
        """The requests no earlier record listed, once each, in order."""
        new = {r.request_id: r for r in requests if r.request_id not in self._known}
        self._known.update(new)
        return [
            {
                "id": rid,
                "prompt_tokens": r.num_prompt_tokens,
                "max_tokens": r.max_tokens,
                "priority": r.priority,
                "arrival": round(r.arrival_time - self._unix_t0, 6),
            }
            for rid, r in new.items()
        ]

    def _blocks(self) -> Record:
        """Reference counts of held blocks, the cached-and-free ones in eviction (LRU) order,
        and the cached blocks that lost their content since the last record."""
        bm = self.engine.block_manager
        blocks = bm.blocks
        cached_map = getattr(bm, "cached_block_hash_to_block", None)
        state: Record = {
            "num_free": bm.get_num_free_blocks(),
            "ref_counts": {str(b): blocks[b].ref_count for b in sorted(bm.used_block_ids)},
            "cached_free": [],
            "evicted": [],
        }
        if cached_map is None:
            return state
        state["cached_free"] = [b for b in bm.free_block_ids if blocks[b].block_hash is not None]
        hashed = {block_id: block_hash for block_hash, block_id in cached_map.items()}
        if self._hashed is not None:
            state["evicted"] = sorted(b for b, h in self._hashed.items() if hashed.get(b) != h)
        self._hashed = hashed
        return state


# ---------------------------------------------------------------------------- reading and checking
class TraceError(ValueError):
    """A trace that cannot be read: the message names the file and the line."""

    def __init__(self, path: str | os.PathLike, line: int, message: str):
        super().__init__(f"{path}:{line}: {message}")
        self.line = line


def parse_record(text: str, line: int, path: str | os.PathLike = "<trace>") -> Record:
    """One line of a trace, checked for shape (JSON object, known type, this schema)."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        cut = "is cut short (was the run killed while writing it?)" if exc.pos >= len(text.rstrip()) else "is not JSON"
        raise TraceError(path, line, f"line {cut}: {exc.msg}") from None
    if not isinstance(record, dict):
        raise TraceError(path, line, f"expected a JSON object, got {type(record).__name__}")
    if record.get("schema") != SCHEMA:
        raise TraceError(path, line, f"schema {record.get('schema')!r}, this reader knows schema {SCHEMA}")
    kind = record.get("type")
    if kind not in ("header", "step", "end"):
        raise TraceError(path, line, f"unknown record type {kind!r}")
    if (kind == "header") != (line == 1):
        raise TraceError(path, line, "the header must be the first line, and only the first")
    return record


def read_trace(path: str | os.PathLike, progress: bool = False) -> tuple[Record, list[Record]]:
    """The header and the step (and end) records of a trace file; :class:`TraceError` names the
    first bad line. ``progress`` shows a tqdm bar (for traces of many thousands of steps)."""
    from tqdm.auto import tqdm

    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise TraceError(path, 1, "the trace is empty (no header line)")
    records = [
        parse_record(text, i, path)
        for i, text in enumerate(tqdm(lines, desc="reading trace", unit="line", disable=not progress), 1)
    ]
    return records[0], records[1:]


@dataclass
class TraceSummary:
    """What :func:`check_trace` counted while checking."""

    steps: int = 0
    requests: set[str] = field(default_factory=set)
    finished: dict[str, str] = field(default_factory=dict)  # id -> finish reason ("abort" too)
    preemptions: int = 0
    evictions: int = 0
    prefix_hit_tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    ended: bool = False


def check_trace(path: str | os.PathLike, require_end: bool = True) -> TraceSummary:
    """Check the invariants of ``docs/step_trace.md`` on every record of a trace; AssertionError
    names the line. With ``require_end`` the ``end`` record must be there, every request ended
    and every block returned."""
    header, records = read_trace(path)
    summary = TraceSummary()
    texts: dict[str, str] = {}
    for line, record in enumerate(records, 2):
        where = f"{path}:{line} (step {record.get('step')})"
        _check_blocks(header, record, where)
        _check_lifecycle(record, summary, texts, where)
        if record["type"] == "step":
            assert record["step"] == summary.steps, f"{where}: expected step {summary.steps}: a record is missing"
            summary.steps += 1
        else:
            assert line == len(records) + 1, f"{where}: a record follows the end record"
            summary.ended = True
    if require_end:
        assert summary.ended, f"{path}: no end record (the engine was not shut down)"
        left = set(summary.requests) - set(summary.finished)
        assert not left, f"{path}: requests never finished nor aborted: {sorted(left)}"
        final = records[-1]["blocks"]
        assert not final["ref_counts"] and final["num_free"] == header["num_blocks"], (
            f"{path}: blocks still held at the end: {final['ref_counts']}"
        )
    return summary


def _check_blocks(header: Record, record: Record, where: str) -> None:
    blocks, num_blocks, block_size = record["blocks"], header["num_blocks"], header["block_size"]
    held = {int(b): n for b, n in blocks["ref_counts"].items()}
    assert blocks["num_free"] + len(held) == num_blocks, (
        f"{where}: {blocks['num_free']} free + {len(held)} held != {num_blocks} blocks"
    )
    assert all(0 <= b < num_blocks and n > 0 for b, n in held.items()), f"{where}: bad held block {held}"
    cached = blocks["cached_free"]
    assert len(set(cached)) == len(cached) and not set(cached) & set(held), (
        f"{where}: a cached-free block is listed twice or is held"
    )
    for rid, req in record["requests"].items():
        assert len(req["blocks"]) * block_size >= req["computed"], (
            f"{where}: {rid}'s {len(req['blocks'])} blocks do not cover its {req['computed']} computed tokens"
        )
    holders = dict(Counter(b for req in record["requests"].values() for b in req["blocks"]))
    assert holders == held, f"{where}: reference counts {held} != block-table holders {holders}"


def _check_lifecycle(record: Record, summary: TraceSummary, texts: dict[str, str], where: str) -> None:
    for new in record["new"]:
        assert new["id"] not in summary.requests, f"{where}: {new['id']} is new twice"
        summary.requests.add(new["id"])
    ended = [(f["id"], f["reason"]) for f in record.get("finished", [])] + [(a, "abort") for a in record["aborted"]]
    for rid, reason in ended:
        assert rid in summary.requests, f"{where}: {rid} ended before it was seen"
        assert rid not in summary.finished, f"{where}: {rid} ended twice"
        summary.finished[rid] = reason
    for rid in record["requests"]:
        assert rid in summary.requests and rid not in summary.finished, f"{where}: {rid} is live but unknown or ended"
    for rid, new_text in record.get("text", {}).items():
        texts[rid] = texts.get(rid, "") + new_text
    for f in record.get("finished", []):
        if "text" in f:
            assert texts.get(f["id"], "") == f["text"], f"{where}: {f['id']}'s text increments != its final text"
    for s in record.get("scheduled", []):
        summary.drafts += s["drafts"]
        summary.accepted += s["accepted"]
    summary.preemptions += len(record.get("preempted", []))
    summary.evictions += len(record["blocks"]["evicted"])
    summary.prefix_hit_tokens += sum(record.get("prefix_hits", {}).values())
