"""``python -m vllm_from_scratch.precompile``: compile a model's forward into the cache, once.

``setup.sh`` runs it, so that no first start of the engine waits minutes for inductor: it builds
the model runner an engine would build at its defaults, on the CPU, which compiles the forward
(``compilation.py``) or finds it already cached, and says which.
"""

from __future__ import annotations

import argparse
import time

from vllm_from_scratch.compilation import cache_root
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.default_model import default_model_dir
from vllm_from_scratch.model_runner import ModelRunner


def main(argv: list[str] | None = None) -> None:
    """Compile a model's forward at the engine's defaults, or find it already cached."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_from_scratch.precompile",
        description="Compile a model's forward into the cache at the engine's defaults (a later start loads it).",
    )
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="as EngineConfig.dtype (default: %(default)s)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    # The graphs do not depend on the cache's size: a few blocks suffice to build them.
    config = EngineConfig(
        args.model or default_model_dir(), device="cpu", dtype=args.dtype, num_kvcache_blocks=16, warm_up=False
    )
    if ModelRunner(config).compiled_forward is None:
        raise SystemExit("the forward could not be compiled here; the engine will run it eagerly")
    print(f"compiled forward ready in {cache_root()} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
