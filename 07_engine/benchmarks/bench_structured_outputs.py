"""What a grammar costs per decode step: the engine with and without a JSON schema, and vLLM's CPU
build on the same workload.

Workload: ``--requests`` copies of one chat prompt asking for a book as JSON, greedy, exactly
``--max-tokens`` new tokens each. The constrained run uses a schema whose array needs more items
than the budget holds, so every step of every request is under the mask (the request ends by
length, never by completing the grammar); the unconstrained run uses ``ignore_eos`` for the same
token count. Runs alternate, unconstrained then constrained, ``--rounds`` times, so each pair
shares the machine's load; each line reports ms per decode step (wall time over
``max_tokens``). For the engine, the time spent building the masks (the matchers' fills) and
applying them (one kernel call) is timed inside the run and reported per step.

``--vllm-python PATH`` also runs the same workload on vLLM (its ``LLM`` with
``StructuredOutputsParams(json=...)``, xgrammar, ``enforce_eager``, the same dtype), in its own
interpreter: this file again, with ``--as-vllm``, which imports nothing from the book.

    .venv/bin/python 07_engine/benchmarks/bench_structured_outputs.py --vllm-python /work/.venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

PROMPT = "Describe a long book as JSON: its title and the names of all its chapters."
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "chapters": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 64},
    },
    "required": ["title", "chapters"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=8, help="requests per run (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="unconstrained/constrained pairs (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="both engines' dtype (default: %(default)s)")
    parser.add_argument("--vllm-python", help="vLLM's interpreter: also run the workload on vLLM's CPU build")
    parser.add_argument("--as-vllm", action="store_true", help="(internal) run the workload on vLLM, print JSON")
    parser.add_argument("--json", help="write the results to this file")
    if "--as-vllm" in (sys.argv[1:] if argv is None else argv):
        return parser.parse_args(argv)  # in vLLM's virtualenv, without the book's modules; the parent checked
    from machine import add_quiet_arg, check_quiet

    add_quiet_arg(parser)
    args = parser.parse_args(argv)
    check_quiet(args.refuse_busy)
    return args


def timed_runs(generate: Callable[[bool], None], rounds: int, max_tokens: int) -> list[dict[str, float]]:
    """``rounds`` pairs of runs (unconstrained, constrained), ms per decode step each."""
    generate(False)  # warm: first-call allocations, the grammar compiled and its tokenizer info built
    generate(True)
    pairs = []
    for _ in range(rounds):
        pair = {}
        for constrained in (False, True):
            start = time.perf_counter()
            generate(constrained)
            pair["constrained" if constrained else "unconstrained"] = (time.perf_counter() - start) * 1e3 / max_tokens
        pairs.append(pair)
    return pairs


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_from_scratch import LLM, SamplingParams, StructuredOutputsParams, default_model_dir, model_runner

    llm = LLM(args.model or default_model_dir(), dtype=args.dtype, enforce_eager=True, max_model_len=512, warm_up=False)
    engine = llm.llm_engine
    mask_s = {"fill": 0.0, "apply": 0.0}
    manager_fill = engine.structured_output.grammar_bitmask
    runner_apply = model_runner.apply_grammar_bitmask

    def fill(*a: Any) -> Any:
        start = time.perf_counter()
        out = manager_fill(*a)
        mask_s["fill"] += time.perf_counter() - start
        return out

    def apply(*a: Any) -> None:
        start = time.perf_counter()
        runner_apply(*a)
        mask_s["apply"] += time.perf_counter() - start

    engine.structured_output.grammar_bitmask = fill  # type: ignore[method-assign]
    model_runner.apply_grammar_bitmask = apply  # type: ignore[assignment]
    steps = 0

    def generate(constrained: bool) -> None:
        nonlocal steps
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not constrained, structured_outputs=so
        )
        outs = llm.chat([[{"role": "user", "content": PROMPT}]] * args.requests, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs), "every request runs max_tokens"
        steps += args.max_tokens if constrained else 0

    pairs = timed_runs(generate, args.rounds, args.max_tokens)
    return {
        "pairs": pairs,
        "mask_fill_ms_per_step": mask_s["fill"] * 1e3 / steps,
        "mask_apply_ms_per_step": mask_s["apply"] * 1e3 / steps,
    }


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    # On a CPU gpu_memory_utilization is the share of the machine's memory vLLM reserves: its
    # default 0.92 refuses to start beside the book's engine and other jobs.
    llm = LLM(
        model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=512, seed=0, gpu_memory_utilization=0.3
    )

    def generate(constrained: bool) -> None:
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not constrained, structured_outputs=so
        )
        outs = llm.chat([[{"role": "user", "content": PROMPT}]] * args.requests, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs), "every request runs max_tokens"

    return {"pairs": timed_runs(generate, args.rounds, args.max_tokens)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.as_vllm:
        print("RESULT " + json.dumps(run_vllm(args)))
        return
    if args.model is None:
        from vllm_from_scratch import default_model_dir

        args.model = default_model_dir()
    results: dict[str, Any] = {"workload": vars(args), "load_before": os.getloadavg()[0], "ours": run_ours(args)}
    print("ours: " + json.dumps(results["ours"]), flush=True)
    if args.vllm_python:
        cmd = [args.vllm_python, __file__, "--as-vllm", "--model", args.model, "--requests", str(args.requests)]
        cmd += ["--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds), "--dtype", args.dtype]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        results["vllm"] = json.loads(line.removeprefix("RESULT "))
    results["load_after"] = os.getloadavg()[0]
    for name in ("ours", "vllm"):
        for i, pair in enumerate(results.get(name, {}).get("pairs", [])):
            extra = pair["constrained"] - pair["unconstrained"]
            print(
                f"{name:5s} pair {i}: unconstrained {pair['unconstrained']:7.2f} ms/step, "
                f"constrained {pair['constrained']:7.2f} ms/step ({extra:+.2f})"
            )
    ours = results["ours"]
    print(
        f"ours: mask fill {ours['mask_fill_ms_per_step']:.3f} ms/step, "
        f"apply {ours['mask_apply_ms_per_step']:.3f} ms/step"
    )
    print(f"load average {results['load_before']:.1f} before, {results['load_after']:.1f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
