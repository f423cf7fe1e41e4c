"""What the step trace costs: ``bench.py``'s serving-shaped workload with the trace off and on.

Two numbers, because a shared CPU moves wall-clock throughput by ±10 % between runs:

* the time spent inside ``StepTracer.on_step`` (building and writing the records), as a share
  of the same run's wall time: the direct cost, which the machine's load barely moves;
* output tokens per second with the trace off and on, one pair per ``--rounds``, in one
  process (the same engine settings, a fresh engine each run).

    python 07_engine/benchmarks/bench_step_trace.py                      # 128 requests, like bench.py: one off/on pair
    python 07_engine/benchmarks/bench_step_trace.py --rounds 3           # three pairs (about 2.5 min each on two cores)
    python 07_engine/benchmarks/bench_step_trace.py --num-requests 32 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import torch

from bench import make_workload
from machine import add_quiet_arg, check_quiet, cpu_name, load_average


def run(model_dir: str, prompts, outputs, trace_path: str | None, **engine_kwargs) -> dict:
    """One engine run of the workload; tokens/s, and the tracer's share when tracing."""
    from vllm_from_scratch import LLM, SamplingParams

    llm = LLM(model_dir, step_trace=trace_path, **engine_kwargs)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    spent = [0.0]
    if engine.tracer is not None:
        on_step = engine.tracer.on_step

        def timed(*args):
            t = time.perf_counter()
            on_step(*args)
            spent[0] += time.perf_counter() - t

        engine.tracer.on_step = timed
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outputs]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    steps = engine.scheduler.num_steps
    llm.shutdown()
    return {
        "tok_s": sum(outputs) / elapsed,
        "elapsed": elapsed,
        "tracer_s": spent[0],
        "steps": steps,
        "bytes": os.path.getsize(trace_path) if trace_path else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--rounds", type=int, default=1, help="off/on pairs to run, one after the other")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_quiet_arg(parser)
    args = parser.parse_args()
    check_quiet(args.refuse_busy)
    from vllm_from_scratch import default_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    prompts, outputs = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), 49152, 0)
    print(
        f"{args.num_requests} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, "
        f"{sum(outputs)} output tokens; {cpu_name()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}, {platform.python_version()}, load {load_average()}"
    )
    # Each row as soon as its run ends, so that a run cut short still leaves the ones before it.
    print(
        f"{'trace':<6}{'output tok/s':>14}{'wall s':>9}{'steps':>7}{'in on_step s':>14}{'share':>8}{'trace MB':>10}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label, path in (("off", None), ("on", os.path.join(tmp, f"trace{i}.jsonl"))):
                r = run(model_dir, prompts, outputs, path, dtype=args.dtype, device="cpu")
                share = r["tracer_s"] / r["elapsed"] if r["tracer_s"] else 0.0
                print(
                    f"{label:<6}{r['tok_s']:>14.1f}{r['elapsed']:>9.1f}{r['steps']:>7}{r['tracer_s']:>14.2f}"
                    f"{share:>8.2%}{r['bytes'] / 1e6:>10.1f}",
                    flush=True,
                )
    print(f"load after: {load_average()}")


if __name__ == "__main__":
    main()
