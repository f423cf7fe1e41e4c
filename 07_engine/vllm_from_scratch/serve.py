"""Serve a model over the OpenAI API: ``python -m vllm_from_scratch.serve [MODEL_DIR] --port N``.

The engine's flags are generated from :class:`config.EngineConfig` (``--help`` lists every
setting with its default, in vLLM's spellings); the routes are in :mod:`api_server`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vllm_from_scratch.config import EngineConfig

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Serve a model over the OpenAI API (completions, chat, SSE streaming, /health, /metrics).")
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the directory's name)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    EngineConfig.add_cli_args(parser)
    return parser.parse_args(argv)


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
    app = build_app(engine, args.served_model_name or Path(model_dir).name,
                    tokenizer=AutoTokenizer.from_pretrained(model_dir))
    log.info("serving %s on http://%s:%d/v1", model_dir, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
