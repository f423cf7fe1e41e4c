"""Server-sent events and the plumbing between engine outputs and an HTTP response.

A completion with several prompts is several engine requests: :func:`merge_streams` interleaves
their outputs (a request with ``n`` > 1 is one stream, its completions' outputs told apart by
their ``CompletionOutput.index``). Both the streamed (:func:`stream_events`) and the whole
(:func:`collect_or_abort`) response abort every engine request still running when the client
goes away, so the engine frees its KV blocks at once instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request

from vllm_from_scratch.async_llm import EngineDeadError, RequestStream
from vllm_from_scratch.openai_protocol import APIError, error_body

if TYPE_CHECKING:
    from vllm_from_scratch.outputs import RequestOutput


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` is sent verbatim)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


class ClientGone(Exception):
    """The client disconnected before a whole (non-streamed) response was ready."""


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with their choice index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer below
            merged.put_nowait((i, exc))
        merged.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def stream_events(
    streams: list[RequestStream], render: Callable[[int, RequestOutput], str | None]
) -> AsyncIterator[str]:
    """The SSE chunks ``render(index, output)`` makes of every output of ``streams[index]``
    (None: nothing to send for it yet)."""
    try:
        async for i, out in merge_streams(streams):
            chunk = render(i, out)
            if chunk is not None:
                yield chunk
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error"))
    except APIError as exc:  # a request the engine ended with an error (serving.raise_if_error)
        yield sse(exc.body())
    finally:  # also the disconnect path: Starlette cancels this generator at its await
        for s in streams:
            s.abort()


async def _collect(streams: list[RequestStream], on_output: Callable[[int, RequestOutput], object]) -> None:
    try:
        async for i, out in merge_streams(streams):
            on_output(i, out)
    finally:
        for s in streams:
            s.abort()


async def collect_or_abort(
    raw: Request, streams: list[RequestStream], on_output: Callable[[int, RequestOutput], object]
) -> None:
    """Run a non-streamed request to the end, aborting it if its client disconnects first."""
    work = asyncio.ensure_future(_collect(streams, on_output))
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work not in done:
        work.cancel()  # its finally aborts the engine requests
        raise ClientGone()
    try:
        work.result()
    except EngineDeadError as exc:
        raise APIError(str(exc), status_code=503) from exc


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
