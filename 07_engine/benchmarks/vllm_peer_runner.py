"""Run bench.py's offline workload on vLLM's CPU build (``bench.py --peer vllm``), or vLLM's
serving benchmark client (``bench_serving.py``).

    .venv-vllm/bin/python 07_engine/benchmarks/vllm_peer_runner.py SPEC.json RESULT.json
    .venv-vllm/bin/python 07_engine/benchmarks/vllm_peer_runner.py bench-serve [vllm bench serve flags]

This file runs in vLLM's own virtualenv (``07_engine/benchmarks/make_vllm_venv.sh``), never in the book's:
it imports vLLM, which the book's environment does not have, and bench.py's helpers (which
need only the standard library and torch). SPEC.json holds the model directory, dtype, prompts
(token ids), output lengths and the quiet-machine policy; RESULT.json gets the throughput, the
load before and after, and what each of vLLM's processes did with the CPU during the timed run
(threads, cores busy, and the core each busy thread was bound to). The thread binding comes
from the environment bench.py sets (``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# bench.py sits beside this file (sys.path[0]); the machine.py it imports is chapter 01's, which
# vLLM's virtualenv does not have installed.
sys.path.append(str(Path(__file__).resolve().parents[2] / "01_paged_kv"))
from bench import LoadWatch  # noqa: E402


def process_tree() -> list:
    """This process and every descendant (vLLM's engine core and its worker)."""
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def thread_seconds(procs: list) -> dict[tuple[int, int], float]:
    """User + system CPU seconds of every thread so far, by (pid, tid); gone processes skipped."""
    out = {}
    for p in procs:
        try:
            out.update({(p.pid, t.id): t.user_time + t.system_time for t in p.threads()})
        except Exception:  # noqa: BLE001  a process may exit between listing and reading
            pass
    return out


def thread_affinity(tid: int) -> list[int]:
    """The cores one thread may run on (vLLM binds each OpenMP thread to its own core)."""
    try:
        return sorted(os.sched_getaffinity(tid))
    except OSError:
        return []


def describe(procs: list, before: dict, after: dict, wall_s: float) -> list[dict]:
    """Per process: name, thread count, cores busy during the timed run, and each busy thread's
    (more than 5 % of the run) binding and load: where vLLM's compute actually ran."""
    rows = []
    for p in procs:
        try:
            name, n_threads = p.name(), p.num_threads()
        except Exception:  # noqa: BLE001
            continue
        busy = {tid: (after[(pid, tid)] - before.get((pid, tid), 0.0)) / wall_s for (pid, tid) in after if pid == p.pid}
        rows.append(
            {
                "pid": p.pid,
                "name": name,
                "threads": n_threads,
                "cores_busy": round(sum(busy.values()), 2),
                "busy_threads": [
                    {"cores": thread_affinity(tid), "busy": round(b, 2)} for tid, b in sorted(busy.items()) if b > 0.05
                ],
            }
        )
    return rows


def run(spec: dict) -> dict:
    """Start vLLM's ``LLM``, warm it up like bench.py's engine, time one ``generate`` of the workload."""
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], seed=0)
    startup_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, as bench_engine
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in spec["outputs"]]

    watch = LoadWatch(spec.get("quiet_below"), spec.get("quiet_deadline"))
    procs = process_tree()
    watch.before()
    cpu_before = thread_seconds(procs)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    cpu_after = thread_seconds(procs)
    watch.after()
    assert [len(o.outputs[0].token_ids) for o in outs] == list(spec["outputs"])
    return {
        "output_tokens_per_s": sum(spec["outputs"]) / elapsed,
        "elapsed_s": elapsed,
        "startup_s": startup_s,
        "vllm_version": vllm.__version__,
        "load": watch.records[-1],
        "processes": describe(procs, cpu_before, cpu_after, elapsed),
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
    }


def bench_serve(argv: list[str]) -> None:
    """``vllm bench serve ARGV`` without the ``vllm`` command, which fails on the package name
    (``vllm-cpu``) here: the same parser and ``main``, called as a library."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    serve_main(parser.parse_args(argv))


def main() -> None:
    if sys.argv[1:2] == ["bench-serve"]:
        return bench_serve(sys.argv[2:])
    if len(sys.argv) != 3:
        print(f"usage: {Path(__file__).name} SPEC.json RESULT.json | bench-serve [vllm bench serve flags]\n{__doc__}")
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec), indent=2))


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    main()
