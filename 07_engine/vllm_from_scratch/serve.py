"""Serve a model over the OpenAI API, as ``vllm serve`` does: ``vllm-fs serve MODEL [flags]``
(also ``python -m vllm_from_scratch.serve [MODEL] [flags]`` and ``vllm-fs-serve``).

Every flag comes from a settings class in :mod:`config`, in vLLM's spellings: the engine's from
:class:`config.EngineConfig`, the server's own (where it listens, names, keys, logging) from
:class:`config.ServerConfig`, and what one request may ask from :class:`config.ServingLimits`.
The command line reads as vLLM's does (:func:`vllm_argv`): ``--config FILE.yaml``,
``--max_model_len`` as well as ``--max-model-len``, ``-O3``. A flag vLLM has for a set-up the
engine lacks (``-pp 2``, ``--kv-cache-dtype fp8``) stops the start with an error naming it; the
deploying page (07_engine/topics/deploying.md) lists every flag of ``vllm serve`` and what it does here.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from vllm_from_scratch.config import EngineConfig, ServerConfig, ServingLimits, flag_of
from vllm_from_scratch.errors import ParameterError

log = logging.getLogger(__name__)

COMMAND = "vllm-fs"
DESCRIPTION = "Serve a model over the OpenAI API (completions, chat, SSE streaming, /health, /metrics)."


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The server's whole command line: the model, then the flags of the three settings classes."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument(
        "model", nargs="?", help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="the same, as vLLM also spells it")
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flags from a YAML file, as vLLM does: `max-model-len: 4k`, `enforce-eager: true`, "
        "dicts as JSON flags; flags on the command line win",
    )
    ServerConfig.add_cli_args(parser)
    ServingLimits.add_cli_args(parser)
    EngineConfig.add_cli_args(parser)
    return parser


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = build_parser(prog)
    try:
        args = parser.parse_args(vllm_argv(sys.argv[1:] if argv is None else argv, parser))
        if args.model and args.model_option and args.model != args.model_option:
            raise ParameterError("model", f"given twice: {args.model!r} and --model {args.model_option!r}")
        args.model = args.model or args.model_option
        args.server = ServerConfig.from_cli_args(args)
        args.limits = ServingLimits.from_cli_args(args)
    except ParameterError as exc:
        parser.error(startup_error(exc))
    return args


def startup_error(exc: ParameterError) -> str:
    """A settings error as the command line spells it: ``--kv-cache-dtype ='fp8': ...``."""
    return f"{flag_of(exc.param)} {str(exc).removeprefix(exc.param).lstrip()}"


# ------------------------------------------------------------------ vLLM's command line
LONG_FLAG_NAME = re.compile(r"^--[^=.]*")


def vllm_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` as vLLM's parser reads it: the flags of ``--config FILE.yaml`` go in after the
    model and before the other flags (so the command line wins), and a long flag may spell its
    name with underscores (``--max_model_len``)."""
    argv = [LONG_FLAG_NAME.sub(lambda m: m.group(0).replace("_", "-"), a) if a.startswith("--") else a for a in argv]
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2) :]
            at = 1 if rest and not rest[0].startswith("-") else 0  # after a positional model
            return rest[:at] + config_file_args(path, parser) + rest[at:]
    return argv


def config_file_args(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a vLLM ``--config`` YAML file stands for: ``key: value`` is ``--key value``;
    ``true`` is ``--key``, ``false`` ``--no-key``; a list gives its items, a dict its JSON."""
    import yaml

    if not path:
        raise ParameterError("config", "needs a YAML file")
    if Path(path).suffix not in (".yaml", ".yml"):
        raise ParameterError("config", f"must be a .yaml or .yml file (vLLM's rule), got {path!r}")
    try:
        document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ParameterError("config", f"cannot read {path!r}: {exc}") from None
    if not isinstance(document, dict):
        raise ParameterError("config", f"{path!r} must hold a mapping of flag names to values")
    flags: list[str] = []
    for key, value in document.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            no_flag = "--no-" + flag[2:]
            if value or no_flag in parser._option_string_actions:
                flags.append(flag if value else no_flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


# ------------------------------------------------------------------ what the flags resolve to
def served_model_names(args: argparse.Namespace) -> list[str]:
    """The ids clients may pass as ``model``: ``--served-model-name``'s, else the model argument
    as given (vLLM's rule: ``vllm serve ./models/x`` serves ``./models/x``), else the default
    model's name. Responses and metrics carry the first."""
    from vllm_from_scratch.default_model import MODEL_NAME

    return args.served_model_name or [args.model or MODEL_NAME]


def sampling_defaults(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """``--generation-config``'s sampling defaults with ``--override-generation-config`` over
    them, logged as vLLM logs them at start-up."""
    from vllm_from_scratch.serving import generation_config_defaults

    applied: dict[str, Any] = {}
    if args.generation_config != "vllm":
        source = model_dir if args.generation_config == "auto" else args.generation_config
        applied, pending = generation_config_defaults(source)
        if applied:
            log.info("default sampling parameters from %s/generation_config.json: %s", source, applied)
        if pending:
            log.warning("generation_config.json sets %s, which SamplingParams has no field for: not applied", pending)
    if args.override_generation_config:
        applied = {**applied, **args.override_generation_config}
        log.info("default sampling parameters with --override-generation-config: %s", applied)
    return applied


def resolve_api_keys(args: argparse.Namespace) -> list[str]:
    """``--api-key``'s keys, else ``VLLM_API_KEY`` (an empty variable counts as unset, as in vLLM)."""
    return list(args.api_key or [key for key in [os.environ.get("VLLM_API_KEY")] if key])


def load_chat_template(template: str) -> str:
    """``--chat-template``: a file's text, or the Jinja text itself (vLLM's rule: text holding
    ``{``, ``}`` or a newline is a template; anything else must be a readable file)."""
    path = Path(template)
    if not any(c in template for c in "{}\n"):
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            message = f"{template!r} is neither a readable file nor a template: {exc}"
            raise ParameterError("chat_template", message) from None
    return template


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = parse_args(argv, prog)
    server: ServerConfig = args.server
    logging.basicConfig(level=server.resolved_log_level(), format="%(levelname)s %(name)s: %(message)s")
    import uvicorn
    from transformers import AutoTokenizer

    from vllm_from_scratch.api_server import build_app
    from vllm_from_scratch.async_llm import build_engine
    from vllm_from_scratch.default_model import default_model_dir
    from vllm_from_scratch.engine import LLMEngine

    model_dir = args.model or default_model_dir()
    try:
        chat_template = load_chat_template(server.chat_template) if server.chat_template else None
        engine = build_engine(lambda: LLMEngine(model_dir, serving=True, **EngineConfig.cli_kwargs(args)))
    except ParameterError as exc:
        raise SystemExit(f"{prog or 'serve'}: error: {startup_error(exc)}") from None
    api_keys = resolve_api_keys(args)
    if not api_keys and not is_loopback(server.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach port %d can use this "
            "server (set --api-key or VLLM_API_KEY)",
            server.host,
            server.port,
        )
    names = served_model_names(args)
    tokenizer = AutoTokenizer.from_pretrained(engine.config.tokenizer or model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    app = build_app(
        engine,
        names,
        tokenizer=tokenizer,
        api_key=api_keys,
        max_request_bytes=server.max_request_bytes,
        default_sampling_params=sampling_defaults(args, model_dir),
        limits=args.limits,
        root_path=server.root_path or "",
        log_requests=server.enable_log_requests,
        log_stats=not engine.config.disable_log_stats,
        tool_parser=server.tool_call_parser if server.enable_auto_tool_choice else None,
    )
    auth = "API key required" if api_keys else "no API key"
    log.info("serving %s as %s on http://%s:%d/v1 (%s)", model_dir, ", ".join(names), server.host, server.port, auth)
    if is_loopback(server.host):
        log.info(
            "listening on %s: this machine only (vLLM listens on every interface); pass --host 0.0.0.0 "
            "to serve other machines",
            server.host,
        )
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.resolved_uvicorn_log_level())


def cli(argv: list[str] | None = None) -> None:
    """The ``vllm-fs`` command, spelled as vLLM's: ``vllm-fs serve MODEL [flags]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {COMMAND} serve [MODEL] [flags]\n\n{DESCRIPTION}\n`{COMMAND} serve --help` lists the flags.")
        raise SystemExit(0 if argv else 2)
    if argv[0] != "serve":
        raise SystemExit(f"{COMMAND}: error: unknown command {argv[0]!r} (this engine has one: serve)")
    main(argv[1:], prog=f"{COMMAND} serve")


if __name__ == "__main__":
    main()
