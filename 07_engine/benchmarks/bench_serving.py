"""Serving throughput and latency of our server beside ``vllm serve``, measured with vLLM's own client.

    .venv/bin/python 07_engine/benchmarks/bench_serving.py --quiet-below 0.5 --json docs/data/vllm_peer_serving.json

Starts our server (``python -m vllm_from_scratch.serve``) and then vLLM's CPU build's server
(``python -m vllm.entrypoints.launchers.api_server.entry`` in vLLM's virtualenv, built by
``07_engine/benchmarks/make_vllm_venv.sh``; its ``vllm`` command fails on the package name there), one after
the other, alone on the machine. Against each, ``vllm bench serve`` (its parser and ``main``,
called by ``vllm_peer_runner.py bench-serve``) first warms the server up on other prompts (another
seed: the same prompts would hit both prefix caches), then runs the measured load::

    --backend openai --endpoint /v1/completions --dataset-name random --random-input-len 256
    --random-output-len 64 --num-prompts 64 --max-concurrency 16 --ignore-eos --save-result

The same client, the same flags and the same seed for both servers. vLLM's server runs at its
defaults (one core computes, one is reserved for its front end) and, with ``--vllm-bindings``,
with every usable core bound. The table gives output tok/s, TTFT p50 and p99, TPOT mean and ITL
p99, with the machine and the load average around each measured run (``--quiet-below`` waits for
a quiet machine first, as bench.py does), and each server's output tok/s as a fraction of the
workload's floor, measured in the same run before and after the servers, each rate the faster
of the two probes (``floors.py``). The verdict judges our server against the faster vLLM run by
``floors.THROUGHPUT_TARGET`` (1.5x its output tok/s or 80 % of the floor, the lower) with a p99
TTFT no longer than its.

One measured run of this load moves by about 7 % from run to run on a shared 2-core VM (225,
238 and 207 tok/s from one server build within minutes): too much to judge a 1.5x target by.
``--rounds N`` measures each server N times, each round on new prompts (seeds ``seed``, then
``seed + 2`` on: every server gets the same ones, and none has them in its prefix cache), and
the table gives each server's median round, with every round's tok/s under it.

The VM's own speed drifts too: three such runs within an hour gave one server 92-96 and the other
58-72 tok/s, their ratio 1.28x, 1.62x and 1.33x (07_engine/topics/other_cpus.md). With
``--interleave`` every server starts and warms up first, and then they take turns, round by round,
so each round of ours sits minutes from the same round of vLLM's and a drift slows both alike.
The servers not being measured are stopped (SIGSTOP, every process of theirs), holding their
memory but no CPU (left idle, vLLM's worker polled at 1.5-2 % of a core). The verdict then also
gives the ratio of every round to its pair::

    .venv/bin/python 07_engine/benchmarks/bench_serving.py --rounds 3 --interleave

``--max-num-batched-tokens N ...`` runs our server once per token budget, the prompt tokens a
step may carry beside the decodes: a larger one prefills a burst of prompts in fewer steps (the
last prompt's first token comes sooner) and holds every decoder longer in each of them. With
``--ours-only`` (no vLLM) that is the sweep that chooses the server's default (``default``: the
server's own, which on a CPU also caps each prompt's chunk)::

    .venv/bin/python 07_engine/benchmarks/bench_serving.py --ours-only --max-num-batched-tokens default 256 512 1024
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from bench import LoadWatch, add_peer_args, machine_info, vllm_bindings, vllm_python
from floors import THROUGHPUT_TARGET, judge, measure_floors
from load_generator import served_model
from machine import add_quiet_arg, check_quiet, load_average, machine_line
from server_testing import ServerProcess

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_peer_runner.py"
# (column, key in vllm bench serve's result file)
METRICS = (
    ("output tok/s", "output_throughput"),
    ("TTFT p50 ms", "median_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("TPOT mean ms", "mean_tpot_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
)


class VenvServer(ServerProcess):
    """A ``ServerProcess`` run by another virtualenv's interpreter, with exactly the given
    ``VLLM_CPU_*`` settings (none inherited from this shell)."""

    def __init__(self, python: Path, args: list[str], env: dict[str, str], startup_timeout_s: float):
        super().__init__(args, startup_timeout_s=startup_timeout_s, env=env)
        self.args[0] = str(python)
        inherited = {k for k in os.environ if k.startswith("VLLM_CPU_") or k == "VIRTUAL_ENV"}
        self.env = {k: v for k, v in self.env.items() if k not in inherited - set(env)}


def vllm_server(
    python: Path,
    model_dir: str,
    dtype: str,
    binding: str,
    kv_cache_gib: int,
    startup_timeout_s: float,
    extra_args: tuple[str, ...] = (),
) -> VenvServer:
    """``vllm serve`` of ``model_dir`` in ``dtype`` from vLLM's virtualenv, with one of bench.py's
    thread layouts (``binding``, a key of ``vllm_bindings()``) and ``kv_cache_gib`` GiB of KV
    cache; ``extra_args`` are more server flags."""
    env = {
        **vllm_bindings()[binding],
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    args = ["vllm.entrypoints.launchers.api_server.entry", "--model", model_dir, "--dtype", dtype, *extra_args]
    return VenvServer(python, args, env, startup_timeout_s)


def client_flags(
    url: str, model: str, tokenizer: str, args: argparse.Namespace, seed: int, num_prompts: int, result: Path | None
) -> list[str]:
    """``vllm bench serve`` flags for one run against ``url`` (``result``: save it there)."""
    flags = [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
    ]
    if result is not None:
        flags += ["--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    return flags


def run_client(python: Path, flags: list[str]) -> None:
    """vLLM's serving benchmark in vLLM's virtualenv; its own report goes to our stdout."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    done = subprocess.run([str(python), str(RUNNER), "bench-serve", *flags], env=env)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {done.returncode} (its output is above)")


def round_seeds(seed: int, rounds: int) -> list[int]:
    """The prompt seeds of ``rounds`` measured runs: ``seed``, then ``seed + 2`` on, skipping the
    warm-up's ``seed + 1`` (prompts a server has seen would come from its prefix cache)."""
    return [seed, *range(seed + 2, seed + rounds + 1)]


def median_round(reports: list[dict]) -> dict:
    """The round of median output tok/s (the lower middle one of an even count), with every
    round's tok/s in order under ``round_throughputs``."""
    if not reports:
        raise ValueError("reports must hold at least one round")
    ranked = sorted(reports, key=lambda r: r["output_throughput"])
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["round_throughputs"] = [round(r["output_throughput"], 1) for r in reports]
    return median


def warm_up(server: ServerProcess, python: Path, model_dir: str, args: argparse.Namespace, tag: str) -> str:
    """Run the warm-up load against ``server`` (other prompts: seed + 1); its served model name."""
    name = served_model(server.url)
    print(f"\n== {tag}: warm-up ({args.warmup_prompts} prompts, seed {args.seed + 1})", flush=True)
    run_client(python, client_flags(server.url, name, model_dir, args, args.seed + 1, args.warmup_prompts, None))
    return name


def measured_round(
    server: ServerProcess,
    name: str,
    python: Path,
    model_dir: str,
    args: argparse.Namespace,
    watch: LoadWatch,
    tmp: Path,
    tag: str,
    index: int,
) -> dict:
    """Measured round ``index`` against a warm ``server`` (after waiting for quiet): vLLM's result,
    with the load around it under ``load``."""
    seed = round_seeds(args.seed, args.rounds)[index]
    result = tmp / f"{tag.replace(' ', '_')}_{index}.json"
    print(f"\n== {tag}: measured run {index + 1}/{args.rounds} ({args.num_prompts} prompts, seed {seed})", flush=True)
    watch.before()
    run_client(python, client_flags(server.url, name, model_dir, args, seed, args.num_prompts, result))
    watch.after()
    report = json.loads(result.read_text())
    report["load"] = watch.records[-1]
    return report


def measure(
    server: ServerProcess, python: Path, model_dir: str, args: argparse.Namespace, watch: LoadWatch, tmp: Path, tag: str
) -> dict:
    """Warm ``server`` up on other prompts, then run the measured load ``args.rounds`` times, each
    after waiting for quiet; vLLM's result of the median round (:func:`median_round`)."""
    with server:
        name = warm_up(server, python, model_dir, args, tag)
        reports = [
            measured_round(server, name, python, model_dir, args, watch, tmp, tag, i) for i in range(args.rounds)
        ]
    return median_round(reports)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it, read from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended while we looked
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def hold(server: ServerProcess, running: bool) -> None:
    """Continue (SIGCONT) or stop (SIGSTOP) every process of a started ``server``."""
    for pid in process_tree(server.proc.pid) if server.proc is not None else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT if running else signal.SIGSTOP)


def measure_interleaved(
    servers: dict[str, ServerProcess],
    python: Path,
    model_dir: str,
    args: argparse.Namespace,
    watch: LoadWatch,
    tmp: Path,
) -> dict[str, dict]:
    """Start and warm up every server, then measure them in turns, round by round (``--interleave``),
    the others stopped (:func:`hold`) while one runs; each server's median round, as
    :func:`measure` gives it."""

    def turn(tag: str) -> ServerProcess:
        for other, server in servers.items():
            hold(server, running=other == tag)
        return servers[tag]

    with contextlib.ExitStack() as started:
        for server in servers.values():
            started.enter_context(server)
        started.callback(lambda: [hold(server, running=True) for server in servers.values()])  # before they exit
        names = {tag: warm_up(turn(tag), python, model_dir, args, tag) for tag in servers}
        reports: dict[str, list[dict]] = {tag: [] for tag in servers}
        for index in range(args.rounds):
            for tag in servers:
                report = measured_round(turn(tag), names[tag], python, model_dir, args, watch, tmp, tag, index)
                reports[tag].append(report)
    return {tag: median_round(rounds) for tag, rounds in reports.items()}


def print_table(results: dict[str, dict], floor: float | None = None) -> None:
    """One line per server: vLLM's client's figures, the output tok/s as a fraction of ``floor``
    (the workload's most tok/s on this machine) and the load around the measured run."""
    floor_head = f"{'of floor':>10}" if floor else ""
    print(f"\n{'server':<44}" + "".join(f"{h:>14}" for h, _ in METRICS) + floor_head + "  load before -> after")
    print("-" * (44 + 14 * len(METRICS) + len(floor_head) + 22))
    for name, r in results.items():
        load = r["load"]
        gave_up = "*" if load.get("quiet") is False else ""
        print(
            f"{name:<44}"
            + "".join(f"{r[key]:>14.1f}" for _, key in METRICS)
            + (f"{r['output_throughput'] / floor:>10.0%}" if floor else "")
            + f"  {load['load_before'].split()[0]} -> {load['load_after'].split()[0]}{gave_up}"
        )
    if any(r["load"].get("quiet") is False for r in results.values()):
        print("* the machine never got quiet before the wait ran out; measured anyway")
    for name, r in results.items():
        if len(r.get("round_throughputs", [])) > 1:
            runs = ", ".join(f"{t:.1f}" for t in r["round_throughputs"])
            print(f"{name}: the median of {len(r['round_throughputs'])} rounds (output tok/s {runs})")


def our_label(budget: int | None) -> str:
    """Our server's row: at its default token budget, or at ``--max-num-batched-tokens budget``."""
    return "our server" if budget is None else f"our server, budget {budget}"


def verdict(results: dict[str, dict], floor_tps: float) -> dict:
    """Our first server run against the best ``vllm serve`` run: the throughput ratio, both
    fractions of the workload's floor (``floor_tps``), the throughput target (``THROUGHPUT_TARGET``:
    1.5x or 80 % of the floor, the lower) and p99 TTFT, which must be no worse; ``met``: both."""
    ours = next(v for k, v in results.items() if k.startswith("our server"))
    peers = {k: v for k, v in results.items() if not k.startswith("our server")}
    if not peers:
        return {}
    best_name = max(peers, key=lambda k: peers[k]["output_throughput"])
    best = peers[best_name]
    throughput = judge(ours["output_throughput"], best["output_throughput"], floor_tps, THROUGHPUT_TARGET)
    ttft_no_worse = ours["p99_ttft_ms"] <= best["p99_ttft_ms"]
    return {
        "against": best_name,
        **throughput,
        "p99_ttft_ms": [round(ours["p99_ttft_ms"], 1), round(best["p99_ttft_ms"], 1)],
        "p99_ttft_no_worse": ttft_no_worse,
        "met": throughput["target_met"] and ttft_no_worse,
        **round_ratios(ours, best),
    }


def round_ratios(ours: dict, peer: dict) -> dict:
    """``{"round_ratios": [...]}``, our tok/s over the peer's round by round, where both ran the
    same rounds (``--rounds`` above one); else ``{}``."""
    mine, theirs = ours.get("round_throughputs", []), peer.get("round_throughputs", [])
    if len(mine) < 2 or len(mine) != len(theirs):
        return {}
    return {"round_ratios": [round(a / b, 3) for a, b in zip(mine, theirs, strict=True)]}


def token_budget(text: str) -> int | None:
    """One ``--max-num-batched-tokens`` value: a positive count, or ``default`` (None: the server's
    own budget, which on a CPU also caps each prompt's chunk)."""
    if text == "default":
        return None
    if not (text.isascii() and text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"a positive token count or 'default', not {text!r}")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="dtype of both servers; auto: the engine's rule (bfloat16 where the CPU has it natively)",
    )
    parser.add_argument("--input-len", type=int, default=256, help="--random-input-len")
    parser.add_argument("--output-len", type=int, default=64, help="--random-output-len")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--warmup-prompts", type=int, default=16, help="warm-up prompts (seed + 1)")
    parser.add_argument("--seed", type=int, default=0, help="the measured run's seed")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measured runs per server, each on new prompts; the table gives the median one",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=token_budget,
        nargs="+",
        default=[None],
        metavar="N",
        help="run our server once per token budget (prompt tokens a step may carry beside the decodes: "
        "how long a prefill chunk delays the decoders), 'default' for the server's own; default: once, "
        "at the server's default",
    )
    add_peer_args(parser, "vLLM server thread layouts to run")
    parser.add_argument("--ours-only", action="store_true", help="run our server(s) only: no vllm serve, no ratio")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every server first, then measure them in turns, round by round (the rest stopped)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=900.0,
        help="per server; vLLM compiles its model at start-up (minutes on 2 cores)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="our server runs its forward eagerly (EngineConfig.enforce_eager): no compiled graphs",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    add_quiet_arg(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    check_quiet(args.refuse_busy)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    python = vllm_python(args.vllm_venv)  # the client is vLLM's too: needed for our server as well
    from vllm_from_scratch import default_model_dir
    from vllm_from_scratch.loader import resolve_dtype

    model_dir = args.model or default_model_dir()
    dtype = resolve_dtype(args.dtype, "cpu")
    args.dtype = str(dtype).removeprefix("torch.")  # vLLM needs a name
    load_before = load_average()
    watch = LoadWatch(args.quiet_below, time.time() + 60 * args.quiet_timeout_min)
    floors = measure_floors(model_dir, dtype)
    ours = ["vllm_from_scratch.serve", model_dir, "--dtype", args.dtype, "--device", "cpu", "--log-level", "warning"]
    ours += ["--enforce-eager"] * args.enforce_eager
    servers = {
        our_label(budget): ServerProcess(
            ours + ["--max-num-batched-tokens", str(budget)] * (budget is not None),
            startup_timeout_s=args.startup_timeout_s,
        )
        for budget in args.max_num_batched_tokens
    }
    for label in [] if args.ours_only else args.vllm_bindings:
        servers[f"vllm serve ({label})"] = vllm_server(
            python, model_dir, args.dtype, label, args.vllm_kv_cache_gib, args.startup_timeout_s
        )
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        if args.interleave:
            results = measure_interleaved(servers, python, model_dir, args, watch, Path(tmp))
        else:
            for name, server in servers.items():
                results[name] = measure(server, python, model_dir, args, watch, Path(tmp), name)
    floors = floors.faster(measure_floors(model_dir, dtype))
    total_in, total_out = args.num_prompts * args.input_len, args.num_prompts * args.output_len
    floor_tps = floors.tokens_per_s(total_in, total_out, args.num_prompts, args.output_len)
    print(
        f"\nvllm bench serve: {args.num_prompts} prompts of {args.input_len} random tokens, {args.output_len} "
        f"new, max concurrency {args.max_concurrency}, ignore_eos, streaming, {args.dtype}"
        f"{'; our server eager' * args.enforce_eager}\n{machine_line()}\n"
        f"load average (1/5/15 min) before {load_before}, after {load_average()}"
    )
    print(f"{floors.describe()}\nthis workload's floor: {floor_tps:.1f} output tok/s")
    print_table(results, floor_tps)
    check = verdict(results, floor_tps)
    if check:
        print(
            f"\nour server / {check['against']}: {check['ratio']:.2f}x output tok/s; "
            f"p99 TTFT {check['p99_ttft_ms'][0]:.0f} vs {check['p99_ttft_ms'][1]:.0f} ms"
        )
        if "round_ratios" in check:
            print("round by round: " + ", ".join(f"{r:.2f}x" for r in check["round_ratios"]))
        print(
            f"target ({check['target']}; p99 TTFT no worse): {check['target_tokens_per_s']:.1f} tok/s, "
            f"{'met' if check['met'] else 'not met'}"
        )
    report = {
        "machine": machine_info(load_before),
        "vllm_python": str(python),
        "workload": {
            k: getattr(args, k)
            for k in (
                "input_len",
                "output_len",
                "num_prompts",
                "max_concurrency",
                "warmup_prompts",
                "seed",
                "rounds",
                "interleave",
                "dtype",
            )
        },
        "floors": {**floors.as_json(), "workload_floor_tokens_per_s": round(floor_tps, 1)},
        "results": results,
        "fraction_of_floor": {name: round(r["output_throughput"] / floor_tps, 3) for name, r in results.items()},
        "verdict": check,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
