"""Serve a model over the OpenAI API: ``python -m vllm_from_scratch.serve [MODEL_DIR] --port N``.

The engine's flags come from :class:`config.EngineConfig` (in vLLM's spellings); the server's
own are here: where it listens, the API key (``--api-key`` or ``VLLM_API_KEY``, as in vLLM) and
the request-size limit.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from vllm_from_scratch.config import EngineConfig

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Serve a model over the OpenAI API (completions, chat, SSE streaming, /health, /metrics)."
    )
    parser.add_argument(
        "model", nargs="?", help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model` (default: the directory's name)"
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
        "(default: the VLLM_API_KEY environment variable, which keeps the key out of "
        "the process list; neither: no key)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=positive_int,
        help="refuse larger request bodies with a 413 before parsing them (default: "
        "128 bytes per token of --max-model-len, plus 64 KiB)",
    )
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.api_key == "":
        parser.error("--api-key is empty (an unset shell variable?); leave the flag out to serve without a key")
    return args


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The flag, else ``VLLM_API_KEY`` (an empty variable counts as unset, as in vLLM)."""
    return args.api_key or os.environ.get("VLLM_API_KEY") or None


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    import uvicorn
    from transformers import AutoTokenizer

    from vllm_from_scratch.api_server import build_app
    from vllm_from_scratch.default_model import default_model_dir
    from vllm_from_scratch.engine import LLMEngine

    model_dir = args.model or default_model_dir()
    engine = LLMEngine(model_dir, **EngineConfig.cli_kwargs(args))
    api_key = resolve_api_key(args)
    if api_key is None and not is_loopback(args.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach port %d can use this "
            "server (set --api-key or VLLM_API_KEY)",
            args.host,
            args.port,
        )
    name = args.served_model_name or Path(model_dir).name
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    app = build_app(engine, name, tokenizer=tokenizer, api_key=api_key, max_request_bytes=args.max_request_bytes)
    auth = "API key required" if api_key else "no API key"
    log.info("serving %s on http://%s:%d/v1 (%s)", model_dir, args.host, args.port, auth)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
