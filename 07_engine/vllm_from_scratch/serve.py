"""An OpenAI-compatible HTTP server for the engine: ``python -m vllm_from_scratch.serve``.

    python -m vllm_from_scratch.serve [MODEL_DIR] --port 8000 [--max-num-seqs 16 ...]

Endpoints (the ones ``vllm serve`` users call every day):

* ``GET  /v1/models``            the one served model;
* ``POST /v1/completions``       text or token-id prompts, ``stream: true`` over SSE;
* ``POST /v1/chat/completions``  messages rendered with the model's chat template;
* ``GET  /health``               200 while the engine loop lives, 503 once it died;
* ``GET  /metrics``              Prometheus text with vLLM's metric names.

Each HTTP request becomes one engine request (one per prompt of a batched completion); the
engine itself runs in a single background loop (:class:`async_llm.AsyncLLM`), so all clients
share its continuously batched steps. A client that disconnects has its request aborted, and
the engine gives its KV blocks back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_from_scratch.async_llm import AsyncLLM, EngineDeadError, RequestStream
from vllm_from_scratch.metrics import CONTENT_TYPE, ServerMetrics
from vllm_from_scratch.openai_protocol import (SSE_DONE, APIError, ChatCompletionRequest,
                                               CompletionRequest, error_body, now, random_id,
                                               sse, usage)
from vllm_from_scratch.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "stop_token_ids",
                   "stop", "seed")


@dataclass
class _Choice:
    """What one choice accumulates while its request runs."""

    prompt_tokens: int
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None

    def update(self, out) -> None:
        self.text += out.new_text
        self.completion_tokens += len(out.new_token_ids)
        self.cached_tokens = out.num_cached_tokens or 0
        if out.finished:
            self.finish_reason = out.finish_reason


class OpenAIServing:
    """The endpoints' logic, independent of FastAPI's routing (and of a real engine in tests)."""

    def __init__(self, llm: AsyncLLM, served_model_name: str, tokenizer, max_model_len: int):
        self.llm = llm
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    # ---- validation ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model `{model}` does not exist.", status_code=404, param="model",
                           code="model_not_found")

    def check_length(self, prompt_len: int, max_tokens: int | None, prompt_param: str) -> int:
        """The request's max_tokens, or a 400 when prompt plus output cannot fit the context."""
        if prompt_len == 0:
            raise APIError(f"{prompt_param} must not be empty", param=prompt_param)
        if prompt_len >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {prompt_len} input tokens. Please reduce the length of the "
                f"input.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {prompt_len} input tokens "
                f"({max_tokens} > {self.max_model_len} - {prompt_len}).", param="max_tokens",
                code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, body, max_tokens: int):
        try:
            return SamplingParams(**body.sampling_kwargs(max_tokens))
        except (TypeError, ValueError) as exc:
            raise APIError(str(exc), param=_param_named_in(str(exc))) from exc

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(body.conversation(), tokenize=False,
                                                      add_generation_prompt=True)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault
            raise APIError(f"cannot apply the chat template: {exc}", param="messages") from exc
        # The template already wrote the special tokens (BOS, role markers).
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- engine requests --------------------------------------------------------------------

    async def start(self, base_id: str, prompts: list[list[int]], params: list,
                    priority: int = 0) -> list[RequestStream]:
        """Add every prompt to the engine; on any refusal, abort the ones already added."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                streams.append(await self.llm.add_request(f"{base_id}-{i}", ids, p, priority))
        except BaseException as exc:
            for s in streams:
                s.abort()
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), status_code=503) from exc
            if isinstance(exc, ValueError):
                raise APIError(str(exc), param=_param_named_in(str(exc))) from exc
            raise
        return streams

    # ---- /v1/completions ------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        prompts = [self.encode_prompt(p) for p in body.prompts()]
        max_tokens = [self.check_length(len(ids), body.max_tokens, "prompt") for ids in prompts]
        params = [self.sampling_params(body, m) for m in max_tokens]
        request_id = random_id("cmpl")
        streams = await self.start(request_id, prompts, params, body.priority)
        choices = [_Choice(prompt_tokens=len(ids)) for ids in prompts]
        header = {"id": request_id, "object": "text_completion", "created": now(),
                  "model": self.served_model_name}
        if body.stream:
            return StreamingResponse(self._completion_events(streams, choices, header, body),
                                     media_type="text/event-stream")
        await _collect_or_abort(raw, streams, choices)
        return JSONResponse({
            **header,
            "choices": [{"index": i, "text": c.text, "logprobs": None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": _total_usage(choices),
        })

    async def _completion_events(self, streams, choices, header, body) -> AsyncIterator[str]:
        def chunk(i: int, text: str, finish_reason: str | None) -> str:
            return sse({**header, "choices": [{"index": i, "text": text, "logprobs": None,
                                               "finish_reason": finish_reason}]})

        async for event in _stream_events(streams, choices, chunk):
            yield event
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": _total_usage(choices)})
        yield SSE_DONE

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        ids = self.encode_chat(body)
        max_tokens = self.check_length(len(ids), body.requested_max_tokens, "messages")
        params = self.sampling_params(body, max_tokens)
        request_id = random_id("chatcmpl")
        streams = await self.start(request_id, [ids], [params], body.priority)
        choices = [_Choice(prompt_tokens=len(ids))]
        header = {"id": request_id, "object": "chat.completion", "created": now(),
                  "model": self.served_model_name}
        if body.stream:
            header["object"] = "chat.completion.chunk"
            return StreamingResponse(self._chat_events(streams, choices, header, body),
                                     media_type="text/event-stream")
        await _collect_or_abort(raw, streams, choices)
        return JSONResponse({
            **header,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": choices[0].text},
                         "logprobs": None, "finish_reason": choices[0].finish_reason}],
            "usage": _total_usage(choices),
        })

    async def _chat_events(self, streams, choices, header, body) -> AsyncIterator[str]:
        def chunk(i: int, text: str | None, finish_reason: str | None, role: bool = False) -> str:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            return sse({**header, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                               "finish_reason": finish_reason}]})

        # OpenAI's first chunk announces the role; content follows in later deltas.
        yield chunk(0, None, None, role=True)
        async for event in _stream_events(streams, choices, chunk):
            yield event
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": _total_usage(choices)})
        yield SSE_DONE


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several requests' outputs as they come, tagged with their choice index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

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


async def _stream_events(streams, choices, chunk) -> AsyncIterator[str]:
    """SSE chunks for every output that carries text or a finish reason.

    The ``finally`` is the disconnect path: when the client goes away Starlette cancels this
    generator at its ``await``, and every request still running is aborted so the engine frees
    its blocks at once instead of generating for nobody.
    """
    try:
        async for i, out in _merge(streams):
            choices[i].update(out)
            if out.new_text or out.finished:
                yield chunk(i, out.new_text, out.finish_reason if out.finished else None)
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error"))
    finally:
        for s in streams:
            s.abort()


async def _collect(streams, choices) -> None:
    try:
        async for i, out in _merge(streams):
            choices[i].update(out)
    finally:
        for s in streams:
            s.abort()


class _ClientGone(Exception):
    pass


async def _collect_or_abort(raw: Request, streams, choices) -> None:
    """Run a non-streamed request to the end, aborting it if its client disconnects first."""
    work = asyncio.ensure_future(_collect(streams, choices))
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work not in done:
        work.cancel()  # its finally aborts the engine requests
        raise _ClientGone()
    try:
        work.result()
    except EngineDeadError as exc:
        raise APIError(str(exc), status_code=503) from exc


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _total_usage(choices: list[_Choice]) -> dict:
    return usage(sum(c.prompt_tokens for c in choices),
                 sum(c.completion_tokens for c in choices),
                 sum(c.cached_tokens for c in choices))


def _param_named_in(message: str) -> str | None:
    """The request field an engine ValueError names (its messages name the argument)."""
    for name in SAMPLING_FIELDS + ("prompt",):
        if re.search(rf"\b{name}\b", message):
            return name
    return None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{e.get('msg')}" for e in errors)
    return APIError(message or "invalid request", param=loc[0] if loc else None)


def build_app(engine, served_model_name: str, tokenizer=None) -> FastAPI:
    """The FastAPI application serving ``engine`` (an ``LLMEngine`` or anything with its API).

    ``tokenizer`` defaults to ``engine.tokenizer``; the CLI passes a second instance so that
    encoding on the event loop never shares a Rust tokenizer with the engine thread.
    """
    metrics = ServerMetrics(served_model_name, lambda: llm.stats)
    llm = AsyncLLM(engine, metrics)
    serving = OpenAIServing(llm, served_model_name, tokenizer or engine.tokenizer,
                            engine.max_model_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        llm.start()
        try:
            yield
        finally:
            llm.shutdown()

    app = FastAPI(title="vllm-from-scratch", lifespan=lifespan)
    app.state.llm = llm
    app.state.serving = serving
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(str(exc.detail), status_code=exc.status_code).body(),
                            status_code=exc.status_code)

    @app.exception_handler(_ClientGone)
    async def on_client_gone(_: Request, __: _ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return JSONResponse(error_body(f"engine loop is dead: {llm.error!r}", "server_error"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": now(),
            "owned_by": "vllm-from-scratch", "max_model_len": serving.max_model_len}]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request):
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await serving.create_chat_completion(body, raw)

    return app


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set; the rest keep ``LLMEngine``'s own defaults."""
    names = ("device", "dtype", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
             "kvcache_block_size", "num_kvcache_blocks", "enable_prefix_caching",
             "enable_chunked_prefill", "tensor_parallel_size", "enforce_eager",
             "gpu_memory_utilization", "cpu_kvcache_space_gib", "scheduling_policy")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Serve a model over the OpenAI API (completions, chat, SSE streaming, "
                    "/health, /metrics).")
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the directory's name)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    engine = parser.add_argument_group("engine arguments (unset ones keep LLMEngine's defaults)")
    engine.add_argument("--device", default=None, help="'auto', 'cpu' or 'cuda'")
    engine.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--block-size", dest="kvcache_block_size", type=int, default=None)
    engine.add_argument("--num-kvcache-blocks", type=int, default=None,
                        help="KV blocks to allocate (default: sized from memory)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                        help="'priority' serves lower `priority` values of the request body first")
    engine.add_argument("--tensor-parallel-size", type=int, default=None)
    engine.add_argument("--enforce-eager", action="store_true", default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=None)
    engine.add_argument("--cpu-kvcache-space-gib", type=float, default=None,
                        help="KV cache size on CPU when --num-kvcache-blocks is not given")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    import uvicorn
    from transformers import AutoTokenizer

    from vllm_from_scratch.default_model import default_model_dir
    from vllm_from_scratch.engine import LLMEngine

    model_dir = args.model or default_model_dir()
    engine = LLMEngine(model_dir, **engine_kwargs(args))
    app = build_app(engine, args.served_model_name or Path(model_dir).name,
                    tokenizer=AutoTokenizer.from_pretrained(model_dir))
    log.info("serving %s on http://%s:%d/v1", model_dir, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
