"""Serve a model over the OpenAI API: ``python -m vllm_from_scratch.serve [MODEL_DIR] --port N``.

The engine's flags come from :class:`config.EngineConfig` (in vLLM's spellings) and the
request limits' from :class:`config.ServingLimits`; the server's own are here: where it listens,
the API key (``--api-key`` or ``VLLM_API_KEY``, as in vLLM) and the request-size limit.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from typing import Any

from vllm_from_scratch.config import EngineConfig, ServingLimits
from vllm_from_scratch.tool_calling import TOOL_PARSERS

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Serve a model over the OpenAI API (completions, chat, SSE streaming, /health, /metrics)."
    )
    parser.add_argument(
        "model", nargs="?", help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="the same, as vLLM also spells it")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the model argument as given, as vLLM names it)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves unset: 'auto' reads the model's "
        "generation_config.json, 'vllm' uses the engine's own defaults, or a directory holding "
        "a generation_config.json (default: %(default)s)",
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
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide whether to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="the format the model writes tool calls in: hermes (<tool_call> JSON: Qwen2.5, Qwen3, "
        "Hermes, SmolLM3) or llama3_json (Llama 3.1+)",
    )
    ServingLimits.add_cli_args(parser)
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.model and args.model_option and args.model != args.model_option:
        parser.error(f"two models given: {args.model!r} and --model {args.model_option!r}")
    args.model = args.model or args.model_option
    if args.api_key == "":
        parser.error("--api-key is empty (an unset shell variable?); leave the flag out to serve without a key")
    return args


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def served_model_name(args: argparse.Namespace) -> str:
    """The id clients pass as ``model``: ``--served-model-name``, else the model argument as
    given (vLLM's rule: ``vllm serve ./models/x`` serves ``./models/x``), else the default
    model's name."""
    from vllm_from_scratch.default_model import MODEL_NAME

    return args.served_model_name or args.model or MODEL_NAME


def sampling_defaults(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """``--generation-config``'s sampling defaults, logged as vLLM logs them at start-up."""
    from vllm_from_scratch.serving import generation_config_defaults

    if args.generation_config == "vllm":
        return {}
    source = model_dir if args.generation_config == "auto" else args.generation_config
    applied, pending = generation_config_defaults(source)
    if applied:
        log.info("default sampling parameters from %s/generation_config.json: %s", source, applied)
    if pending:
        log.warning("generation_config.json sets %s, which SamplingParams has no field for: not applied", pending)
    return applied


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
    from vllm_from_scratch.async_llm import build_engine
    from vllm_from_scratch.default_model import default_model_dir
    from vllm_from_scratch.engine import LLMEngine

    model_dir = args.model or default_model_dir()
    engine = build_engine(lambda: LLMEngine(model_dir, serving=True, **EngineConfig.cli_kwargs(args)))
    api_key = resolve_api_key(args)
    if api_key is None and not is_loopback(args.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach port %d can use this "
            "server (set --api-key or VLLM_API_KEY)",
            args.host,
            args.port,
        )
    name = served_model_name(args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    app = build_app(
        engine,
        name,
        tokenizer=tokenizer,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        default_sampling_params=sampling_defaults(args, model_dir),
        limits=ServingLimits.from_cli_args(args),
        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
    )
    auth = "API key required" if api_key else "no API key"
    log.info("serving %s on http://%s:%d/v1 (%s)", model_dir, args.host, args.port, auth)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
