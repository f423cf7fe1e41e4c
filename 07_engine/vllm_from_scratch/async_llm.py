"""One engine loop, many asyncio clients: the bridge between ``LLMEngine.step()`` and HTTP.

The engine assumes one caller, so exactly one thread touches it: the *engine loop*. Handlers post
commands (add, abort) to a thread-safe queue and read their own request's outputs from an
``asyncio.Queue`` that the loop fills with ``loop.call_soon_threadsafe``; so every client's
requests share one continuously batched step. When nothing runs, the loop blocks on the queue.
A server builds its engine with :func:`build_engine`, so that on a CPU the engine loop's thread
is the only one that keeps OpenMP workers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_from_scratch.input_processor import EngineCoreRequest

if TYPE_CHECKING:
    from vllm_from_scratch.engine import LLMEngine
    from vllm_from_scratch.outputs import RequestOutput
    from vllm_from_scratch.sampling_params import SamplingParams

log = logging.getLogger(__name__)

EngineT = TypeVar("EngineT")
# The most time one turn of the engine loop spends taking new requests while others run.
ADD_BUDGET_S = 0.05
# Steps that may fail in a row, each costing its own requests, before the engine is taken for
# dead (/health then answers 503): a fault that every step meets is no single request's doing.
MAX_FAILED_STEPS = 3


def build_engine(factory: Callable[[], EngineT]) -> EngineT:
    """``factory()`` (an engine's construction) run in a thread that has ended when this returns.

    On a CPU, every thread that runs a parallel region keeps a pool of OpenMP worker threads for
    good, and GNU OpenMP stops spinning between regions (its workers sleep at once and must be
    woken for the next region) when it manages more threads than there are CPUs. An engine built
    on the main thread (loading, packing and warming up all run parallel regions) and then
    stepped on the engine loop's thread leaves two pools: on 2 cores a decode step of 16 requests
    then took 42-45 ms instead of 30-32 (07_engine/topics/performance.md). The building thread's
    pool ends with it, and the engine loop's thread owns the only one. ``factory``'s exception,
    if any, is raised here.
    """
    built: list[EngineT] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            built.append(factory())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="engine-build")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return built[0]


class EngineDeadError(RuntimeError):
    """The engine loop died (an exception in ``step()``); the server can only report it."""


@dataclass
class _Stream:
    """Per-request state owned by the engine thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | EngineCoreRequest
    params: SamplingParams | None
    priority: int
    stream: _Stream
    accepted: asyncio.Future = field(repr=False)


@dataclass
class _Abort:
    request_id: str


_SHUTDOWN = object()


class RequestStream:
    """The outputs of one request, as an async iterator; ``abort()`` cancels it in the engine.

    With ``n`` > 1 the outputs of its completions come interleaved (each ``RequestOutput``'s
    completion ``index`` tells them apart), and the stream ends with the output that finishes
    the request (``RequestOutput.finished``: its last completion has ended).
    """

    def __init__(self, owner: AsyncLLM, request_id: str, stream: _Stream):
        self.owner = owner
        self.request_id = request_id
        self._stream = stream
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[Any]:
        while not self.finished:
            item = await self._stream.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """Runs ``engine`` in one background thread and serves its outputs to asyncio tasks.

    ``stats`` is the engine's ``get_stats()`` snapshot, taken on the engine thread after each
    step and before its outputs go out, for ``/metrics`` to read from any thread (the engine's
    own stat logger, if any, hears of each request on the engine thread).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.stats: dict = dict(engine.get_stats())
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._failed_steps = 0  # steps that raised, in a row
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (failing what still runs), then the engine's workers, if it has any."""
        if self._thread.is_alive():
            self._commands.put(_SHUTDOWN)
            self._thread.join(timeout)
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | EngineCoreRequest,
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it (its ``ValueError`` if not).

        ``prompt`` is an :class:`EngineCoreRequest` the caller's input processor made (the
        server's, in its worker threads; ``request_id``, ``params`` and ``priority`` are then
        its own), or text or token ids with ``params`` and ``priority``, which the engine's input
        processor checks on the engine thread, refusing a ``max_tokens`` that cannot fit (the
        OpenAI API's rule) where offline use cuts it.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop=loop, queue=asyncio.Queue())
        accepted = loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, priority, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left before the engine took the request
            raise
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        """Ask the engine loop to abort ``request_id`` (no-op if it already finished)."""
        self._commands.put(_Abort(request_id))

    # ---- the engine thread runs everything below -------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._apply_commands(block=not self.engine.has_unfinished_requests()):
                    return
                outputs = self._step() if self.engine.has_unfinished_requests() else []
                # The snapshot before the outputs: a client that has its tokens finds them counted.
                self.stats = dict(self.engine.get_stats())
                self._dispatch(outputs)
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the clients
            log.exception("engine loop died")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

    def _step(self) -> list[RequestOutput]:
        """One engine step. If it raises, the engine ends the requests that step had scheduled
        with finish reason "error" and the loop goes on (``recover_from_failed_step``), unless
        :data:`MAX_FAILED_STEPS` steps in a row failed: then the engine is taken for dead."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            recover = getattr(self.engine, "recover_from_failed_step", None)
            self._failed_steps += 1
            if recover is None or self._failed_steps >= MAX_FAILED_STEPS:
                raise
            log.exception("an engine step failed; the requests it had scheduled end with an error")
            return recover(exc)
        self._failed_steps = 0
        return outputs

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False means shut down.

        While requests run (``block`` False), one turn spends at most :data:`ADD_BUDGET_S` on
        commands before the next step: a burst of requests, each validated and built here, is
        admitted over a few steps instead of holding every running stream until all are in.
        """
        deadline = None if block else time.perf_counter() + ADD_BUDGET_S
        while True:
            if deadline is not None and time.perf_counter() > deadline:
                return True
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _SHUTDOWN:
                self._fail_all(EngineDeadError("the server is shutting down"))
                return False
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._abort(command.request_id)

    def _add(self, command: _Add) -> None:
        try:
            request = command.prompt
            if not isinstance(request, EngineCoreRequest):
                processor = self.engine.input_processor
                request = processor.process_inputs(
                    command.request_id, request, command.params, command.priority, fit_max_tokens=False
                )
            self.engine.add_request(request)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, the loop lives on
            _resolve(command.stream.loop, command.accepted, exc)
            return
        self._streams[request.request_id] = command.stream
        _resolve(command.stream.loop, command.accepted, None)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client while the step ran
            if out.finished:
                del self._streams[out.request_id]
            _push(stream, out)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            _push(stream, exc)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                _resolve(command.stream.loop, command.accepted, exc)


def _push(stream: _Stream, item: object) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass  # the client's event loop is closed: nobody is listening any more


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, exc: BaseException | None) -> None:
    def settle() -> None:
        if future.done():
            return
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
