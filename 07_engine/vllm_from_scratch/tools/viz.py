"""The classroom viewer: a step trace in, one self-contained HTML page out (and a Perfetto file).

    python -m vllm_from_scratch.tools.viz TRACE.jsonl -o TRACE.html
    python -m vllm_from_scratch.tools.viz TRACE.jsonl --chrome-trace TRACE.perfetto.json --check

The page inlines its assets (``viz_page.html``/``.css``/``.js`` beside this file), so it opens
offline; the server's ``/viz`` serves it fed live (:mod:`viz_server`). What the page and the
Perfetto file show: ``docs/step_trace.md``. Also here: the chapter demos' ``--trace`` scenarios.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_from_scratch.step_trace import Record, TraceError, check_trace, read_trace


# ---------------------------------------------------------------------------- the page
def _asset(name: str) -> str:
    return resources.files("vllm_from_scratch.tools").joinpath(name).read_text(encoding="utf-8")


def _script_json(value: Any) -> str:
    """JSON that can sit inside a <script> element: ``<`` only occurs inside JSON strings, where
    ``\\u003c`` means the same, so no ``</script>`` or ``<!--`` in the data can end the element."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def render_page(config: dict, records: list[Record] | None = None) -> str:
    """The viewer as one HTML string: its CSS and JS inlined, ``config`` (``mode`` "file" or
    "live", ``source``, ``events``) and the trace's ``records`` (header first) embedded."""
    trace = "\n".join(_script_json(r) for r in records or [])
    page = _asset("viz_page.html")
    for marker, value in (
        ("/*VFS:CSS*/", _asset("viz_page.css")),
        ("/*VFS:JS*/", _asset("viz_page.js")),
        ("/*VFS:CONFIG*/", _script_json(config)),
    ):
        page = page.replace(marker, value, 1)
    return page.replace("/*VFS:TRACE*/", trace, 1)  # last: the trace may hold any text


def write_page(trace_path: str | Path, out_path: str | Path, progress: bool = False) -> int:
    """Validate ``trace_path`` (:class:`TraceError` names a bad line) and write the page;
    returns the number of steps."""
    header, records = read_trace(trace_path, progress=progress)
    page = render_page({"mode": "file", "source": Path(trace_path).name}, [header, *records])
    Path(out_path).write_text(page, encoding="utf-8")
    return sum(r["type"] == "step" for r in records)


# ---------------------------------------------------------------------------- Chrome trace events
ENGINE_PID, REQUESTS_PID = 1, 2


def chrome_trace(header: Record, records: list[Record]) -> dict:
    """The run in Chrome's trace-event format, times in microseconds from the trace's start: process
    "engine" with a span per step and counters, process "requests" with a track per request (its
    spans: docs/step_trace.md, "Perfetto")."""
    events: list[dict] = [
        _event("M", ENGINE_PID, "process_name", args={"name": "engine"}),
        _event("M", ENGINE_PID, "thread_name", tid=0, args={"name": "steps"}),
        _event("M", REQUESTS_PID, "process_name", args={"name": "requests"}),
    ]
    tracks = _RequestTracks(events)
    for rec in records:
        tracks.see(rec)
        if rec["type"] != "step":
            continue
        t, dur = _us(rec["t"]), _us(rec["duration"])
        budget, blocks = rec["budget"], rec["blocks"]
        cached = len(blocks["cached_free"])
        step_args = {**budget, "running": len(rec["running"]), "waiting": len(rec["waiting"])}
        block_args = {"held": len(blocks["ref_counts"]), "cached_free": cached, "free": blocks["num_free"] - cached}
        events += [
            _event("X", ENGINE_PID, f"step {rec['step']}", ts=t, tid=0, dur=dur, args=step_args),
            _event("C", ENGINE_PID, "tokens", ts=t, args={k: budget[k] for k in ("prefill", "decode", "verify")}),
            _event("C", ENGINE_PID, "blocks", ts=t, args=block_args),
        ]
        tracks.step(rec, t, dur)
    # Open spans end at the end record, or with the last step of a run cut short.
    tracks.close(records[-1]["t"] + records[-1].get("duration", 0) if records else 0)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {k: header[k] for k in ("model", "num_blocks", "block_size", "token_budget")},
    }


def _us(seconds: float) -> int:
    return int(round(seconds * 1e6))


def _event(ph: str, pid: int, name: str, **fields: Any) -> dict:
    """One trace event: phase ``ph`` ("X" span, "C" counter, "i" mark, "M" metadata) and its fields."""
    return {"ph": ph, "pid": pid, "name": name, **fields}


class _RequestTracks:
    """Per-request spans, opened and closed as the records go by."""

    def __init__(self, events: list[dict]):
        self.events = events
        self.tid: dict[str, int] = {}
        self.open: dict[str, tuple[str, int, dict]] = {}  # rid -> (name, start µs, args)

    def see(self, rec: Record) -> None:
        for new in rec["new"]:
            tid = self.tid.setdefault(new["id"], len(self.tid) + 1)
            self.events.append(_event("M", REQUESTS_PID, "thread_name", tid=tid, args={"name": new["id"]}))
            self._begin(new["id"], "queued", _us(max(new["arrival"], 0.0)), {"prompt_tokens": new["prompt_tokens"]})

    def step(self, rec: Record, t: int, dur: int) -> None:
        for rid in rec["preempted"]:
            self._begin(rid, "preempted", t + dur, {})
        for s in rec["scheduled"]:
            span = self.open.get(s["id"])
            if span is None or span[0] != s["kind"]:
                self._begin(s["id"], s["kind"], t, {"steps": 0, "tokens": 0})
            args = self.open[s["id"]][2]
            args["steps"] += 1
            args["tokens"] += s["tokens"]
            args["end"] = t + dur  # a work span ends with its last step, not when the next span begins
        for rid in [f["id"] for f in rec["finished"]] + rec["aborted"]:
            self._end(rid, t + dur)
            name = "aborted" if rid in rec["aborted"] else "finished"
            self.events.append(_event("i", REQUESTS_PID, name, ts=t + dur, tid=self.tid.get(rid, 0), s="t"))

    def close(self, t_seconds: float) -> None:
        for rid in list(self.open):
            self._end(rid, _us(t_seconds))

    def _begin(self, rid: str, name: str, ts: int, args: dict) -> None:
        self._end(rid, ts)
        self.open[rid] = (name, ts, args)

    def _end(self, rid: str, ts: int) -> None:
        if rid not in self.open:
            return
        name, start, args = self.open.pop(rid)
        end = args.pop("end", ts)
        tid = self.tid.get(rid, 0)
        self.events.append(_event("X", REQUESTS_PID, name, ts=start, tid=tid, dur=max(end - start, 0), args=args))


def write_chrome_trace(trace_path: str | Path, out_path: str | Path) -> None:
    """Read ``trace_path`` (:class:`TraceError` names a bad line) and write :func:`chrome_trace` of it."""
    header, records = read_trace(trace_path)
    Path(out_path).write_text(json.dumps(chrome_trace(header, records)), encoding="utf-8")


# ---------------------------------------------------------------------------- scenarios (the chapter demos)
@dataclass
class Arrival:
    """One request of a scenario: a user message (rendered with the model's chat template,
    after ``system`` when given), greedy for ``max_tokens``, added before engine step ``step``."""

    text: str
    max_tokens: int = 16
    step: int = 0
    system: str | None = None
    priority: int = 0


def trace_scenario(
    path: str | Path, arrivals: list[Arrival], model_dir: str | None = None, **engine_kwargs: Any
) -> dict[str, str]:
    """Run ``arrivals`` through a fresh engine (the default model unless ``model_dir``) with the
    step trace written to ``path``; returns each request's text by request id (``req-0``, ...
    in the order of ``arrivals``). The chapter demos' ``--trace`` is this, with their scenario."""
    from vllm_from_scratch.default_model import default_model_dir
    from vllm_from_scratch.engine import LLMEngine
    from vllm_from_scratch.sampling_params import SamplingParams

    engine = LLMEngine(model_dir or default_model_dir(), step_trace=str(path), **engine_kwargs)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError(f"{engine.config.model_dir} has no tokenizer; a scenario's arrivals are chat messages")
    pending = sorted(enumerate(arrivals), key=lambda a: a[1].step)
    texts: dict[str, str] = {}
    step = 0
    try:
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][1].step <= step:
                i, a = pending.pop(0)
                messages = [{"role": "system", "content": a.system}] if a.system else []
                messages.append({"role": "user", "content": a.text})
                prompt = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
                params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
                engine.add_request(prompt, params, request_id=f"req-{i}", priority=a.priority)
            texts.update((o.request_id, o.outputs[0].text) for o in engine.step() if o.finished)
            step += 1
    finally:
        engine.shutdown()
    return texts


def demo_trace(path: str | Path, arrivals: list[Arrival], **engine_kwargs: Any) -> None:
    """A chapter demo's ``--trace``: run the scenario, check the trace, say how to view it."""
    texts = trace_scenario(path, arrivals, **engine_kwargs)
    header, records = read_trace(path)
    summary = check_trace(path)
    prompts = {n["id"]: n["prompt_tokens"] for r in records for n in r["new"]}
    print(
        f"wrote {path}: {summary.steps} engine steps of {header['model']}, {header['num_blocks']} KV blocks "
        f"of {header['block_size']} tokens, budget {header['token_budget']} tokens/step; invariants hold"
    )
    for rid, text in sorted(texts.items(), key=lambda item: int(item[0].split("-")[1])):
        print(f"  {rid}: {prompts[rid]} prompt tokens -> {text[:60]!r}{'...' if len(text) > 60 else ''}")
    print(f"view it: python -m vllm_from_scratch.tools.viz {path} -o {Path(path).with_suffix('.html')}")


def add_trace_argument(parser: argparse.ArgumentParser) -> None:
    """A chapter demo's ``--trace PATH``, which :func:`demo_trace` then runs."""
    parser.add_argument(
        "--trace",
        metavar="PATH",
        help="instead: run this chapter's scenario through the real engine on the default model "
        "and write its step trace (docs/step_trace.md)",
    )


# ---------------------------------------------------------------------------- the command line
def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (2: an unreadable trace, 1: a broken invariant)."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_from_scratch.tools.viz",
        description="Turn an engine step trace (EngineConfig.step_trace, --step-trace, or a chapter demo's "
        "--trace) into a self-contained HTML viewer, and optionally a Chrome/Perfetto trace.",
    )
    parser.add_argument("trace", help="the step trace: JSON lines, header first (docs/step_trace.md)")
    parser.add_argument("-o", "--output", help="the HTML page to write (default: the trace's name with .html)")
    parser.add_argument(
        "--chrome-trace", metavar="OUT.json", help="also write Chrome's trace-event format (open it in ui.perfetto.dev)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also check the invariants (blocks, reference counts, lifecycles) on every step",
    )
    args = parser.parse_args(argv)
    out = args.output or str(Path(args.trace).with_suffix(".html"))
    try:
        steps = write_page(args.trace, out, progress=True)
        print(f"wrote {out}: {steps} steps")
        if args.chrome_trace:
            write_chrome_trace(args.trace, args.chrome_trace)
            print(f"wrote {args.chrome_trace} (Chrome trace events: open it in ui.perfetto.dev)")
        if args.check:
            summary = check_trace(args.trace, require_end=False)
            print(
                f"invariants hold on {summary.steps} steps, {len(summary.requests)} requests ({summary.preemptions} "
                f"preemptions, {summary.evictions} evictions, {summary.prefix_hit_tokens} prefix-hit tokens, "
                f"{summary.accepted}/{summary.drafts} drafts accepted)"
            )
    except (TraceError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except AssertionError as exc:
        print(f"error: invariant broken: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
