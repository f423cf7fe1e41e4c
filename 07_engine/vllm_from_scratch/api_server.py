"""The OpenAI-compatible HTTP routes, in one place: which URL does what.

* ``GET  /v1/models``            the one served model;
* ``POST /v1/completions``       text or token-id prompts, ``stream: true`` over SSE;
* ``POST /v1/chat/completions``  messages rendered with the model's chat template;
* ``POST /tokenize``, ``/detokenize``  vLLM's: text or messages to token ids, and back;
* ``GET  /health``, ``/ping``     200 while the engine loop lives, 503 once it died (``/ping``
  also answers POST, as vLLM's);
* ``GET  /version``              ``{"version": ...}``;
* ``GET  /metrics``              Prometheus text with vLLM's metric names: the engine's
  ``vllm:`` families, the process's (``process_*``, ``python_*``) and the HTTP ones
  (``http_*``, from prometheus-fastapi-instrumentator, set up as vLLM sets it up).

Three guards, ASGI middleware in front of every route, answer before FastAPI reads the body:
the API key (:class:`APIKeyMiddleware`), the size limit (:class:`RequestSizeLimitMiddleware`) and
text that is not Unicode (:class:`UnicodeTextMiddleware`). Every error, an unexpected one
included, leaves as a JSON body in OpenAI's shape (:func:`add_error_handlers`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.metadata
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_from_scratch.async_llm import AsyncLLM
from vllm_from_scratch.config import ServingLimits
from vllm_from_scratch.metrics import CONTENT_TYPE
from vllm_from_scratch.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    now,
)
from vllm_from_scratch.serving import OpenAIServing
from vllm_from_scratch.streaming import ClientGone
from vllm_from_scratch.tools.viz_server import add_viz_routes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm_from_scratch.engine import LLMEngine


# Paths open without the API key: load balancers' probes and Prometheus scrapers. An allow-list,
# so that a route added later (a /viz page) is protected by default.
# /ping and /version are vLLM's probes, open there too. (vLLM leaves every path outside /v1
# open, /tokenize included; here those need the key: a stranger's tokenize is CPU time.)
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
# Paths whose requests the http_* families leave out (vLLM's list: probes and the scrape itself).
UNINSTRUMENTED_PATHS = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]
log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return importlib.metadata.version("vllm-from-scratch")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0.0.0+unknown"


VERSION = _version()

# A request body may hold this many bytes per token of max_model_len, so a prompt of that many
# tokens always fits however it is written: the default model's longest token is 82 bytes as a
# JSON string, \u-escaped text about 12 a token, a token id at most 7 ("49151, ").
BYTES_PER_TOKEN = 128
# The rest of the body: sampling fields, stop strings, the model name.
BODY_OVERHEAD_BYTES = 64 * 1024


def default_max_request_bytes(max_model_len: int) -> int:
    """The request-size limit when none is given: 576 KiB for a 4,096-token context. A body over
    it cannot hold a prompt the engine would take (a batch of long prompts may need
    ``--max-request-bytes``)."""
    return max_model_len * BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES


def build_app(
    engine: LLMEngine,
    served_model_name: str | Sequence[str],
    tokenizer: PreTrainedTokenizerBase | None = None,
    api_key: str | Sequence[str] | None = None,
    max_request_bytes: int | None = None,
    default_sampling_params: Mapping[str, Any] | None = None,
    limits: ServingLimits | None = None,
    root_path: str = "",
    log_requests: bool = False,
    log_stats: bool = False,
    tool_parser: str | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` (an ``LLMEngine`` or anything with its API).

    ``served_model_name``: the name, or names, clients may pass as ``model`` (responses and
    metrics carry the first, as vLLM's do).
    ``tokenizer`` defaults to ``engine.tokenizer``; the CLI passes a second instance, because
    the server tokenizes in worker threads while the engine thread detokenizes with its own.
    ``api_key``: a key, or several; if set, every path but :data:`OPEN_PATHS` needs one of them
    as a bearer token.
    ``max_request_bytes``: the largest request body accepted (default
    :func:`default_max_request_bytes` of the engine's ``max_model_len``).
    ``default_sampling_params``: the model's sampling defaults for fields a request leaves unset
    (:func:`serving.generation_config_defaults`). ``limits``: what one request may ask for
    (:class:`config.ServingLimits`; default: its defaults). ``root_path``: the prefix a proxy
    serves the app under. ``log_requests``: log each request as it arrives. ``log_stats``: log
    the engine's throughput and load every ``VLLM_LOG_STATS_INTERVAL`` seconds while it works
    (:func:`log_stats_forever`). ``tool_parser``: how "auto" tool
    calls are found in a chat's text (``tool_calling.TOOL_PARSERS``; None: "auto" is refused).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    llm = AsyncLLM(engine)
    registry = metrics_registry()
    if not getattr(engine.config, "disable_log_stats", False):
        engine.attach_metrics(names[0], lambda: llm.stats, registry)
    serving = OpenAIServing(
        llm,
        names,
        engine.input_processor.with_tokenizer(tokenizer or engine.tokenizer),
        default_sampling_params,
        getattr(engine.config, "scheduling_policy", "fcfs"),
        limits,
        log_requests,
        tool_parser,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        llm.start()
        stats_task = asyncio.create_task(log_stats_forever(llm, names[0])) if log_stats else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            serving.shutdown()
            llm.shutdown()

    app = FastAPI(title="vllm-from-scratch", lifespan=lifespan)
    app.root_path = root_path  # as vLLM sets it: routes answer with the prefix or without it
    app.state.serving = serving

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)

    # response_model=None: the dict goes out as it is, not validated against the annotation.
    @app.get("/v1/models", response_model=None)
    async def list_models() -> dict[str, Any]:
        # One card per name, as vLLM lists them; max_model_len is vLLM's addition to OpenAI's card.
        created = now()
        cards = [
            {"id": name, "object": "model", "created": created, "owned_by": "vllm-from-scratch", "root": names[0]}
            for name in names
        ]
        for card in cards:
            card["max_model_len"] = serving.max_model_len
        return {"object": "list", "data": cards}

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: Annotated[Any, Body()]) -> dict[str, Any]:
        # FastAPI parses the JSON (its errors are the other routes' 400s); "messages" picks
        # vLLM's chat shape.
        kind: type[BaseModel] = (
            TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        )
        try:
            request = kind.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc
        return await serving.tokenize(request)  # type: ignore[arg-type]

    @app.post("/detokenize", response_model=None)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await serving.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return JSONResponse(error_body(f"engine loop is dead: {llm.error!r}", "server_error"), status_code=503)
        return Response(status_code=200)

    # vLLM's /ping (SageMaker's probe): the health check, on GET and POST.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version", response_model=None)
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    Instrumentator(excluded_handlers=UNINSTRUMENTED_PATHS, registry=registry).add().instrument(app)

    add_viz_routes(app, engine)
    add_error_handlers(app)
    # Each added one wraps the ones before: the key is checked before the body is read at all,
    # and the size before the text is looked at.
    app.add_middleware(UnicodeTextMiddleware)
    app.add_middleware(
        RequestSizeLimitMiddleware, max_bytes=max_request_bytes or default_max_request_bytes(engine.max_model_len)
    )
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys)
    return app


def metrics_registry() -> CollectorRegistry:
    """A server's registry, with what ``prometheus_client``'s global one holds by default (the
    process, platform and garbage-collector families): per server, so that two servers in one
    process keep their own counts, and the process families appear once in each."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


STATS_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries", "prefix_cache_hits")


async def log_stats_forever(llm: AsyncLLM, model_name: str) -> None:
    """vLLM's stats line, every ``VLLM_LOG_STATS_INTERVAL`` seconds (10 unless set) in which the
    engine had work: prompt and generation throughput over the interval, running and waiting
    requests, KV cache use and the prefix cache's hit rate."""
    interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL") or 10.0)
    interval = interval if interval > 0 else 10.0
    last, last_time = dict(llm.stats), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        stats, now_s = dict(llm.stats), time.monotonic()
        elapsed = max(now_s - last_time, 1e-9)
        delta = {key: float(stats.get(key, 0)) - float(last.get(key, 0)) for key in STATS_COUNTERS}

        busy = stats.get("num_requests_running", 0) or stats.get("num_requests_waiting", 0)
        if busy or delta["prompt_tokens_total"] or delta["generation_tokens_total"]:
            queries = delta["prefix_cache_queries"]
            log.info(
                "%s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                model_name,
                delta["prompt_tokens_total"] / elapsed,
                delta["generation_tokens_total"] / elapsed,
                stats.get("num_requests_running", 0),
                stats.get("num_requests_waiting", 0),
                100 * float(stats.get("kv_cache_usage", 0.0)),
                100 * delta["prefix_cache_hits"] / queries if queries else 0.0,
            )
        last, last_time = stats, now_s


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body (``{"error": {message, type, param, code}}``)."""

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if isinstance(exc.__cause__, ValueError | RecursionError):
            # FastAPI's "error parsing the body": say why (bad UTF-8, nesting too deep).
            message = f"Invalid JSON body: {exc.__cause__}"
        return error_response(APIError(message, status_code=exc.status_code))

    @app.exception_handler(ClientGone)
    async def on_client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's doing: still OpenAI's body (Starlette's default is plain text),
        # and the traceback in the server's log (Starlette logs it after this answer).
        return error_response(APIError(f"Internal server error: {exc!r}", status_code=500))


def validation_error(exc: RequestValidationError, max_listed: int = 3) -> APIError:
    """A body that does not parse or has the wrong shape: a 400 naming the first bad field.

    The message lists the first ``max_listed`` errors: a client's mistake repeated over a long
    list is one mistake, and must not come back as a megabyte of messages.
    """

    def loc(error: dict[str, Any]) -> list[str]:  # the field's path inside the body
        return [str(x) for x in error.get("loc", ()) if x != "body"]

    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    message = "; ".join(f"{'.'.join(loc(e)) or 'body'}: {e.get('msg')}" for e in errors[:max_listed])
    if len(errors) > max_listed:
        message += f"; and {len(errors) - max_listed} more"
    first_loc = loc(first)
    return APIError(message or "invalid request", param=first_loc[0] if first_loc else None)


# ---- the guards: pure ASGI middleware, so they answer before FastAPI reads the body ---------------


class APIKeyMiddleware:
    """vLLM's ``--api-key``: every path but :data:`OPEN_PATHS` needs ``Authorization: Bearer <key>``
    with one of ``api_keys``, else a 401 with OpenAI's body. Keys are compared as SHA-256 digests
    with ``hmac.compare_digest``, against every key whatever matched: constant time on equal
    lengths whatever the client sent, so timing tells nothing about the keys.
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or get_route_path(scope) in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            err = APIError("Unauthorized", 401, code="invalid_api_key")
            await error_response(err, headers={"www-authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        # Headers are latin-1 text; back to the bytes the client sent.
        value = Headers(scope=scope).get("authorization", "").encode("latin-1")
        scheme, _, token = value.partition(b" ")
        digest = hashlib.sha256(token).digest()
        matches = [hmac.compare_digest(digest, known) for known in self._digests]
        return scheme.lower() == b"bearer" and any(matches)


class RequestSizeLimitMiddleware:
    """A request body over ``max_bytes`` gets a 413 before anything parses it.

    A declared ``Content-Length`` over the limit is refused unread; any other body is read here
    (chunked uploads declare no length), stopping past the limit, and handed on whole: the JSON
    parser and validators after it, which hold the event loop, never see more than the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        declared_too_large = declared.isdigit() and int(declared) > self.max_bytes
        try:
            body = None if declared_too_large else await read_body(receive, self.max_bytes)
        except ClientDisconnect:
            return  # the client left mid-upload: nobody to answer
        if body is None:
            message = f"Request body is too large: this server accepts at most {self.max_bytes} bytes"
            await error_response(APIError(message, status_code=413))(scope, receive, send)
            return
        await self.app(scope, replay(body, receive), send)


async def read_body(receive: Receive, max_bytes: int | None) -> bytes | None:
    """The request body, or None as soon as it passes ``max_bytes`` (None: no limit)."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        body += message.get("body", b"")
        if max_bytes is not None and len(body) > max_bytes:
            return None
        if not message.get("more_body", False):
            return bytes(body)


# A JSON escape of a UTF-16 surrogate, \uD800 to \uDFFF: the only way a body that is valid UTF-8
# can carry one. Escaped pairs (emoji from clients that escape non-ASCII) decode to one character.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class UnicodeTextMiddleware:
    """A JSON body whose strings hold a lone UTF-16 surrogate gets a 400 naming the field.

    ``"a\\ud800b"`` is valid JSON but not text: Python keeps the lone surrogate in the ``str``,
    and it fails later wherever the text is encoded (the tokenizer, a response that quotes it) as
    a 500. The raw body is searched for a surrogate escape first, so only bodies that have one
    are parsed here (a ``json.loads`` bounded by the size limit, run before this).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, max_bytes=None)
        except ClientDisconnect:
            return
        assert body is not None  # no limit here: the size limit was checked outside
        where = lone_surrogate(body) if SURROGATE_ESCAPE.search(body) else None
        if where is not None:
            path, index = where
            message = f"{path} is not valid Unicode text: a lone UTF-16 surrogate at character {index}"
            param = re.split(r"[.\[]", path, maxsplit=1)[0] or None
            await error_response(APIError(message, param=param))(scope, receive, send)
            return
        await self.app(scope, replay(body, receive), send)


def lone_surrogate(body: bytes) -> tuple[str, int] | None:
    """The first string of JSON ``body`` (an object key or a value) that holds a lone surrogate:
    its path (``messages[0].content``) and the character's index; None when there is none or
    the body is not JSON (the route's own parsing answers that)."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                return path or "body", err.start
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                # The path is sent back to the client: a bad key is shown escaped.
                name = key.encode("utf-8", "backslashreplace").decode()
                stack.append((f"{path}.{name}" if path else name, item))
                stack.append((f"{path}.{name}" if path else name, key))  # the key itself, checked first
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def get_route_path(scope: Scope) -> str:
    """The path the routes see: the request's, less the ``root_path`` a proxy serves the app under."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` once, then listens to the client again (so a
    disconnect still reaches the handler that waits for one)."""
    sent = False

    async def receive_again() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``err``'s OpenAI error body with its status code (an ASGI app too, for the guards)."""
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)
