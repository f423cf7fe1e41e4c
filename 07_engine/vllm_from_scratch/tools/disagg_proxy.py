"""Prefill/decode disaggregation: one OpenAI endpoint in front of prefill and decode instances.

    python -m vllm_from_scratch.tools.disagg_proxy --prefill http://HOST:8100 --decode http://HOST:8200 --port 8000

Each completion first goes to a *prefill* instance with ``max_tokens=1``: it computes the
prompt's K/V and publishes every full block to the global KV pool (``kv_role`` "kv_producer").
Then the request, unchanged, goes to a *decode* instance ("kv_consumer"), which finds the
prompt's blocks in the pool, loads them instead of computing them, and only decodes; its answer
(streamed or not) passes through. Several ``--prefill`` / ``--decode`` URLs are used round robin.
A prefill that fails is no reason to fail the request: the decode instance then computes the
prompt itself.

With ``--api-key`` clients must send ``Authorization: Bearer KEY``; ``--backend-api-key`` is
what the proxy sends to the instances (default: the same key).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_from_scratch.api_server import APIKeyMiddleware
from vllm_from_scratch.openai_protocol import error_body

log = logging.getLogger(__name__)
ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(path: str, body: dict) -> dict:
    """The same request, cut to one generated token and not streamed."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    return {**body, "max_tokens": 1, "stream": False}


def build_proxy(
    prefill_urls: list[str],
    decode_urls: list[str],
    api_key: str | None = None,
    backend_api_key: str | None = None,
    timeout_s: float = 600.0,
) -> FastAPI:
    """The proxy application: ``prefill_urls`` compute and publish, ``decode_urls`` answer."""
    if not prefill_urls or not decode_urls:
        raise ValueError("prefill_urls and decode_urls must each name at least one instance")
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    backend_headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
    client = httpx.AsyncClient(timeout=timeout_s, headers=backend_headers)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="vllm-from-scratch disaggregation proxy", lifespan=lifespan)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_keys=[api_key])  # the server's own check, same open paths

    async def forward(request: Request) -> Response:
        path = request.url.path
        try:
            body = await request.json()
        except ValueError as exc:
            return JSONResponse(error_body(f"Invalid JSON body: {exc}"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the body must be a JSON object"), status_code=400)
        try:
            pre = await client.post(next(prefills) + path, json=prefill_body(path, body))
            if pre.status_code >= 400:
                return Response(pre.content, pre.status_code, media_type="application/json")
        except httpx.HTTPError as exc:
            log.warning("prefill instance failed (%s); the decode instance computes the prompt", exc)
        upstream = client.build_request("POST", next(decodes) + path, json=body)
        reply = await client.send(upstream, stream=True)
        if body.get("stream"):
            return StreamingResponse(
                _relay(reply),
                status_code=reply.status_code,
                media_type=reply.headers.get("content-type", "text/event-stream"),
            )
        content = await reply.aread()
        await reply.aclose()
        return Response(content, reply.status_code, media_type=reply.headers.get("content-type"))

    for route in ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        reply = await client.get(next(decodes) + "/v1/models")
        return Response(reply.content, reply.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


async def _relay(reply: httpx.Response) -> AsyncIterator[bytes]:
    """Stream the decode instance's bytes through; closing it (a client that left) aborts there."""
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    finally:
        await reply.aclose()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill instance (kv_role kv_producer); repeat for several",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode instance (kv_role kv_consumer); repeat for several",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="clients must send this key (default: $VLLM_API_KEY, or none)",
    )
    parser.add_argument("--backend-api-key", default=None, help="key sent to the instances (default: --api-key)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    import uvicorn

    app = build_proxy(
        [u.rstrip("/") for u in args.prefill],
        [u.rstrip("/") for u in args.decode],
        args.api_key,
        args.backend_api_key or args.api_key,
    )
    log.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
