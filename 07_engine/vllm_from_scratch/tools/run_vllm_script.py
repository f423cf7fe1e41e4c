"""Run a script written for vLLM, unchanged, on this book's engine.

    python -m vllm_from_scratch.tools.run_vllm_script [--model-dir DIR] [--set KEY=VALUE ...] SCRIPT.py [ARGS...]

The script's ``import vllm`` (and the submodules vLLM's offline examples use) gets the book's
names: ``LLM``, ``LLMEngine``, ``EngineArgs``, ``SamplingParams``, ``BeamSearchParams``,
``RequestOutput``, ``CompletionOutput``, and argparse's parser for vLLM's
``FlexibleArgumentParser``. A model the script names that is not a local directory (a Hugging Face
id such as ``facebook/opt-125m``: this engine downloads nothing) is replaced by ``--model-dir``
(default: the embedded default model), with a log line saying so. ``--set`` gives every engine
the script builds a default setting (an :class:`~vllm_from_scratch.config.EngineConfig` field,
the value read as JSON when it parses, else as a string), such as ``--set enforce_eager=true``;
what the script passes itself wins. ``--max-tokens N`` caps the ``max_tokens`` of every
``SamplingParams`` and ``BeamSearchParams`` the script makes (a quick run of a long example).
``ARGS``, everything after ``SCRIPT.py``, become the script's ``sys.argv[1:]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import runpy
import sys
import types
from typing import Any

from vllm_from_scratch import outputs, sampling_params
from vllm_from_scratch.config import EngineArgs, EngineConfig
from vllm_from_scratch.engine import LLMEngine
from vllm_from_scratch.llm import LLM

log = logging.getLogger(__name__)


def _engine_kwargs(
    model: str | None, model_dir: str, defaults: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[str, dict]:
    if model is None or not os.path.isdir(model):
        if model is not None:
            log.warning("%r is not a local directory: running %s instead", model, model_dir)
        model = model_dir
    return model, {**defaults, **kwargs}


def vllm_modules(
    model_dir: str, defaults: dict[str, Any], max_tokens: int | None = None
) -> dict[str, types.ModuleType]:
    """The ``vllm`` package and submodules a vLLM script imports, made of the book's classes."""

    def capped(value: int | None) -> int | None:
        return value if max_tokens is None or (value is not None and value <= max_tokens) else max_tokens

    @dataclasses.dataclass
    class ScriptSamplingParams(sampling_params.SamplingParams):
        __doc__ = sampling_params.SamplingParams.__doc__

        def __post_init__(self) -> None:
            self.max_tokens = capped(self.max_tokens)
            super().__post_init__()

    @dataclasses.dataclass
    class ScriptBeamSearchParams(sampling_params.BeamSearchParams):
        __doc__ = sampling_params.BeamSearchParams.__doc__

        def __post_init__(self) -> None:
            self.max_tokens = capped(self.max_tokens)  # type: ignore[assignment]  # a capped int stays an int
            super().__post_init__()

    class ScriptLLM(LLM):
        __doc__ = LLM.__doc__

        def __init__(self, model: str | None = None, **kwargs: Any):
            model, kwargs = _engine_kwargs(model, model_dir, defaults, kwargs)
            super().__init__(model, **kwargs)

    class ScriptEngineArgs(EngineArgs):
        __doc__ = EngineArgs.__doc__

        def __init__(self, model: str | None = None, **kwargs: Any):
            model, kwargs = _engine_kwargs(model, model_dir, defaults, kwargs)
            super().__init__(model, **kwargs)

        @classmethod
        def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
            # A flag left at its default gives way to --set; one the script's user passed does not.
            unset = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
            parsed = EngineArgs.from_cli_args(args).engine_kwargs
            return cls(args.model, **{k: v for k, v in parsed.items() if k not in defaults or v != unset[k]})

    names = {
        "LLM": ScriptLLM,
        "LLMEngine": LLMEngine,
        "EngineArgs": ScriptEngineArgs,
        "SamplingParams": ScriptSamplingParams,
        "BeamSearchParams": ScriptBeamSearchParams,
        "RequestOutput": outputs.RequestOutput,
        "CompletionOutput": outputs.CompletionOutput,
    }
    modules: dict[str, dict[str, Any]] = {
        "vllm": names,
        "vllm.sampling_params": {k: names[k] for k in ("SamplingParams", "BeamSearchParams")},
        "vllm.outputs": {k: names[k] for k in ("RequestOutput", "CompletionOutput")},
        "vllm.engine.arg_utils": {"EngineArgs": ScriptEngineArgs},
        "vllm.utils": {"FlexibleArgumentParser": argparse.ArgumentParser},
        "vllm.utils.argparse_utils": {"FlexibleArgumentParser": argparse.ArgumentParser},
        "vllm.engine": {},
    }
    made = {}
    for name, attrs in modules.items():
        module = types.ModuleType(name, f"This book's engine under vLLM's name {name!r} (run_vllm_script).")
        module.__dict__.update(attrs)
        module.__path__ = []  # a package, so that its submodules import
        made[name] = module
    return made


def _setting(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_script(
    script: str,
    script_args: list[str],
    model_dir: str,
    settings: dict[str, Any] | None = None,
    max_tokens: int | None = None,
) -> None:
    """Run ``script`` as ``__main__`` with ``script_args``, its ``vllm`` imports resolved to the
    book's classes; ``sys.argv`` and ``sys.modules`` are as they were afterwards."""
    modules = vllm_modules(model_dir, settings or {}, max_tokens)
    saved_argv, saved = sys.argv, {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Run a vLLM script, unchanged, on this book's engine (its `import vllm` gets the book's classes)."
    )
    parser.add_argument("script", help="the Python file to run")
    parser.add_argument(
        "--model-dir", help="the model for names that are not local directories (default: the embedded model)"
    )
    parser.add_argument(
        "--set",
        dest="settings",
        type=_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting every engine the script builds defaults to (JSON value, else a string)",
    )
    parser.add_argument("--max-tokens", type=int, help="cap every max_tokens the script asks for")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="everything after the script: its own arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.model_dir is None:
        from vllm_from_scratch.default_model import default_model_dir

        args.model_dir = default_model_dir()
    run_script(args.script, args.script_args, args.model_dir, dict(args.settings), args.max_tokens)


if __name__ == "__main__":
    main()
