"""``/viz`` on the OpenAI server: the step-trace viewer, fed live while requests run.

``GET /viz`` is the viewer page of :mod:`viz` in live mode; ``GET /viz/events`` streams
server-sent events: ``event: header`` once, then one ``data:`` step record per engine step. Both
sit behind the server's API key. The stream is redacted (:class:`Redactor`): it shows no more
about a request than ``/metrics`` shows about the engine (why: ``docs/step_trace.md``). While
no viewer is connected the tracer has no sink; a viewer that cannot keep up loses steps (a
bounded queue per viewer) and never slows the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from vllm_from_scratch.step_trace import Record, StepTracer
from vllm_from_scratch.tools.viz import render_page

if TYPE_CHECKING:
    from vllm_from_scratch.engine import LLMEngine

KEEPALIVE_S = 15.0
QUEUE_SIZE = 512  # steps a slow viewer may lag behind before it loses some


class Redactor:
    """A step record made fit for the live page: labels for request ids, no text, no tokens. Used
    from the engine thread only (the tracer's sinks run there), so it needs no lock."""

    def __init__(self) -> None:
        self._labels: dict[str, str] = {}
        self._next = 1

    def label(self, rid: str) -> str:
        if rid not in self._labels:
            self._labels[rid] = f"r{self._next}"
            self._next += 1
        return self._labels[rid]

    def __call__(self, rec: Record) -> Record:
        lab = self.label
        # Labels go to ids in the order first seen: keep the order of the fields below.
        out: Record = {
            k: rec[k] for k in ("type", "schema", "step", "t", "duration", "budget", "loading", "blocks") if k in rec
        }
        out["loading"] = [lab(r) for r in rec["loading"]]
        out["new"] = [{**n, "id": lab(n["id"])} for n in rec["new"]]
        out["scheduled"] = [
            {k: v for k, v in s.items() if k != "sampled"} | {"id": lab(s["id"])} for s in rec.get("scheduled", [])
        ]
        for key in ("admitted", "preempted", "aborted"):
            out[key] = [lab(r) for r in rec.get(key, [])]
        out["prefix_hits"] = {lab(r): n for r, n in rec.get("prefix_hits", {}).items()}
        out["finished"] = [
            {"id": lab(f["id"]), "reason": f["reason"], "completion_tokens": f["completion_tokens"]}
            for f in rec.get("finished", [])
        ]
        out["waiting"] = [{**w, "id": lab(w["id"])} for w in rec["waiting"]]
        out["running"] = [{**r, "id": lab(r["id"])} for r in rec["running"]]
        out["requests"] = {lab(r): v for r, v in rec["requests"].items()}
        if "pool" in rec:
            pool = rec["pool"]
            out["pool"] = {key: {lab(r): n for r, n in pool[key].items()} for key in ("loaded", "published")}
            out["pool"]["totals"] = pool["totals"]
        for rid in [f["id"] for f in rec.get("finished", [])] + rec.get("aborted", []):
            self._labels.pop(rid, None)  # the label dies with the request
        return out


class LiveTrace:
    """Fans the engine's step records out to the connected viewers (the tracer's sink while there are any)."""

    def __init__(self, engine: LLMEngine):
        if engine.tracer is None:
            engine.tracer = StepTracer(engine)  # before the engine loop starts: no race
        self.tracer: StepTracer = engine.tracer
        self._viewers: tuple[tuple[asyncio.AbstractEventLoop, asyncio.Queue], ...] = ()  # (event loop, queue) each
        self._redact = Redactor()

    def header(self) -> Record:
        return {**self.tracer.header(), "redacted": True}

    def _on_record(self, record: Record) -> None:
        """The tracer's sink, on the engine thread: redact and serialize once, post to all."""
        text = json.dumps(self._redact(record), separators=(",", ":"))
        for loop, queue in self._viewers:
            try:
                loop.call_soon_threadsafe(_offer, queue, text)
            except RuntimeError:
                pass  # that viewer's event loop is closed

    async def events(self, request: Request) -> AsyncIterator[str]:
        """One viewer's SSE stream: the header, then every step until it disconnects."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        viewer = (asyncio.get_running_loop(), queue)
        if not self._viewers:
            self._redact = Redactor()
            self.tracer.add_sink(self._on_record)
        self._viewers = (*self._viewers, viewer)
        try:
            yield f"event: header\ndata: {json.dumps(self.header(), separators=(',', ':'))}\n\n"
            while not await request.is_disconnected():
                try:
                    text = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                yield f"data: {text}\n\n"
        finally:
            self._viewers = tuple(v for v in self._viewers if v is not viewer)
            if not self._viewers:
                self.tracer.remove_sink(self._on_record)


def _offer(queue: asyncio.Queue, text: str) -> None:
    if not queue.full():
        queue.put_nowait(text)


def add_viz_routes(app: FastAPI, engine: LLMEngine) -> None:
    """Serve the viewer at ``/viz`` and the live step records at ``/viz/events`` for ``engine``."""
    live = LiveTrace(engine)
    page = render_page({"mode": "live", "source": "live", "events": "viz/events"})
    app.state.viz = live

    @app.get("/viz", response_class=HTMLResponse, include_in_schema=False)
    async def viz_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/viz/events", include_in_schema=False)
    async def viz_events(request: Request) -> StreamingResponse:
        return StreamingResponse(
            live.events(request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
