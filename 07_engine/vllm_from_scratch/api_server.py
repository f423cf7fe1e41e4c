"""The OpenAI-compatible HTTP routes, in one place: which URL does what.

* ``GET  /v1/models``            the one served model;
* ``POST /v1/completions``       text or token-id prompts, ``stream: true`` over SSE;
* ``POST /v1/chat/completions``  messages rendered with the model's chat template;
* ``GET  /health``               200 while the engine loop lives, 503 once it died;
* ``GET  /metrics``              Prometheus text with vLLM's metric names.

The endpoints' logic is :mod:`serving`'s, the SSE plumbing :mod:`streaming`'s, the wire format
:mod:`openai_protocol`'s; the engine runs in one background loop (:mod:`async_llm`), so every
client shares its continuously batched steps.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_from_scratch.async_llm import AsyncLLM
from vllm_from_scratch.metrics import CONTENT_TYPE, ServerMetrics
from vllm_from_scratch.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                               error_body, now)
from vllm_from_scratch.serving import OpenAIServing
from vllm_from_scratch.streaming import ClientGone
from vllm_from_scratch.viz_server import add_viz_routes


def build_app(engine, served_model_name: str, tokenizer=None) -> FastAPI:
    """The FastAPI application serving ``engine`` (an ``LLMEngine`` or anything with its API).

    ``tokenizer`` defaults to ``engine.tokenizer``; the CLI passes a second instance, because
    the server tokenizes in worker threads while the engine thread detokenizes with its own.
    """
    metrics = ServerMetrics(served_model_name, lambda: llm.stats)
    llm = AsyncLLM(engine, metrics)
    serving = OpenAIServing(llm, served_model_name, tokenizer or engine.tokenizer, engine.max_model_len)

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

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request):
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await serving.create_chat_completion(body, raw)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": now(),
            "owned_by": "vllm-from-scratch", "max_model_len": serving.max_model_len}]}

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return JSONResponse(error_body(f"engine loop is dead: {llm.error!r}", "server_error"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    add_viz_routes(app, engine)
    add_error_handlers(app)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body (``{"error": {message, type, param, code}}``)."""

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError):
        err = validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(str(exc.detail), status_code=exc.status_code).body(),
                            status_code=exc.status_code)

    @app.exception_handler(ClientGone)
    async def on_client_gone(_: Request, __: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def validation_error(exc: RequestValidationError) -> APIError:
    """A body that does not parse or has the wrong shape: a 400 naming the first bad field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{e.get('msg')}" for e in errors)
    return APIError(message or "invalid request", param=loc[0] if loc else None)
