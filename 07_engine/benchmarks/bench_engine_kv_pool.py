"""Two engine processes on one Mooncake store: what the global KV pool saves the second one.

    .venv/bin/python 07_engine/benchmarks/bench_engine_kv_pool.py            # default model, 16 requests (~2 min)

It starts ``mooncake_master`` and a ``mooncake_client`` that holds the pool (chapter 03's
launcher), then runs three engine *processes* in turn on the same workload (``--requests``
prompts sharing a ``--shared-len``-token system prompt, each with ``--distinct-len`` tokens of
its own):

1. **cold**: an instance without a pool computes every prompt (the baseline);
2. **A** (``kv_role`` kv_producer): serves one request with the system prompt, publishing its
   blocks, and exits;
3. **B** (kv_consumer, a fresh process, empty local cache): serves the workload, loading the
   system prompt from the pool instead of computing it.

For cold and B it prints time to first token (mean, p99), the wall time until every request
has its first token (their prefill), the prompt tokens computed, and whether B's greedy tokens
equal cold's. Then the break-even: the bytes of one block, the measured load rate and prefill
rate on this machine, and, on paper, a GPU with a 100 Gb/s link.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import add_quiet_arg, check_quiet

HERE = Path(__file__).resolve().parent


def instance(spec: dict) -> dict:
    """One engine process: serve ``spec``'s prompts, time them, report (runs in a subprocess)."""
    from bench_chapters import percentile, run
    from vllm_from_scratch import SamplingParams
    from vllm_from_scratch.engine import LLMEngine

    kwargs = dict(
        device="cpu",
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        kvcache_block_size=spec["block_size"],
        enforce_eager=spec["enforce_eager"],
        warm_up=spec["warm_up"],
    )
    if spec.get("pool"):
        kwargs["kv_transfer_config"] = spec["pool"]
    engine = LLMEngine(spec["model"], **kwargs)
    # Long enough to query the pool, so the first timed request does not pay for the first
    # contact with the store.
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    run(engine, {0: [("warm-up", list(range(11, 11 + 3 * spec["block_size"])), warm, 0)]})
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    stats_before = engine.get_stats()
    timeline = run(engine, {0: [(f"r{i}", p, params, 0) for i, p in enumerate(spec["prompts"])]})
    ids = [f"r{i}" for i in range(len(spec["prompts"]))]
    ttfts = [timeline.ttft(r) for r in ids]
    stats = engine.get_stats()
    # Counters only: get_stats() also holds per-position lists (speculative decoding's acceptances).
    delta = {k: v - stats_before.get(k, 0) for k, v in stats.items() if isinstance(v, (int, float))}
    loaded_tokens = delta.get("kv_pool_loaded_blocks", 0) * engine.config.kvcache_block_size
    report = {
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "prefill_s": max(timeline.token_times[r][0] for r in ids) - min(timeline.arrival.values()),
        "prompt_tokens": delta["prompt_tokens_total"],
        "prompt_tokens_computed": delta["prompt_tokens_total"] - delta["prefix_cache_hits"] - loaded_tokens,
        "outputs": [timeline.outputs[r] for r in ids],
        "pool": {k: v for k, v in delta.items() if k.startswith("kv_pool_")},
    }
    engine.shutdown()
    return report


def run_instance(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "--instance", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"instance failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def workload(vocab: int, args) -> tuple[list[int], list[list[int]]]:
    import random

    rng = random.Random(args.seed)
    system = [rng.randrange(10, vocab) for _ in range(args.shared_len)]
    prompts = [system + [rng.randrange(10, vocab) for _ in range(args.distinct_len)] for _ in range(args.requests)]
    return system, prompts


def serve_args(model: str, args, pool: dict | None) -> list[str]:
    argv = [
        "vllm_from_scratch.serve",
        model,
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--block-size",
        str(args.block_size),
        "--log-level",
        "warning",
        *["--enforce-eager"] * args.enforce_eager,
    ]
    return argv + (["--kv-transfer-config", json.dumps(pool)] if pool else [])


def load_test(url: str, args, out: Path) -> dict:
    """07_engine/benchmarks/load_generator.py (``vllm bench serve``'s measurements) against ``url``."""
    cmd = [
        sys.executable,
        str(HERE / "load_generator.py"),
        "--base-url",
        url,
        "--num-requests",
        str(args.pd_requests),
        "--request-rate",
        str(args.pd_rate),
        "--input-len",
        args.pd_input_len,
        "--output-len",
        args.pd_output_len,
        "--seed",
        str(args.seed),
        "--quiet",
        "--result-json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["summary"]


def prefill_decode(model: str, args, master, tmp: Path) -> dict:
    """The same load against one instance on both cores, and against a prefill instance and a
    decode instance (one core each) behind the proxy."""
    from server_testing import ServerProcess

    pool = {
        "kv_connector": "mooncake",
        "master_server_address": master.master_addr,
        "metadata_server": master.metadata_url,
        "global_segment_size": 0,
    }
    results = {}
    with ServerProcess(serve_args(model, args, None), env={"OMP_NUM_THREADS": "2"}) as single:
        results["one instance (2 cores)"] = load_test(single.url, args, tmp / "single.json")
    one_core = {"OMP_NUM_THREADS": "1"}
    with (
        ServerProcess(serve_args(model, args, {**pool, "kv_role": "kv_producer"}), env=one_core) as prefill,
        ServerProcess(serve_args(model, args, {**pool, "kv_role": "kv_consumer"}), env=one_core) as decode,
        ServerProcess(
            ["vllm_from_scratch.tools.disagg_proxy", "--prefill", prefill.url, "--decode", decode.url]
        ) as proxy,
    ):
        results["prefill + decode (1 core each)"] = load_test(proxy.url, args, tmp / "pd.json")
    print(
        f"\nP/D: {args.pd_requests} requests at {args.pd_rate}/s, prompts {args.pd_input_len} tokens, "
        f"{args.pd_output_len} new"
    )
    print("| setup | TTFT mean ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.0f} | "
            f"{r['p99_itl_ms']:.0f} | {r['output_throughput']:.1f} |"
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--shared-len", type=int, default=1000)
    parser.add_argument("--distinct-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16, help="KV block size of every instance")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="every engine runs its forward eagerly (no compiled graphs)"
    )
    parser.add_argument("--pd", action="store_true", help="also measure prefill/decode disaggregation (servers)")
    parser.add_argument("--pd-requests", type=int, default=24)
    parser.add_argument("--pd-rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--pd-input-len", default="256:768", help="prompt tokens, N or LOW:HIGH")
    parser.add_argument("--pd-output-len", default="32:64", help="new tokens, N or LOW:HIGH")
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each engine process warms up at start-up, as by default (the timed requests then meet no new shape)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--instance", default=None, help=argparse.SUPPRESS)
    add_quiet_arg(parser)
    args = parser.parse_args(argv)
    check_quiet(args.refuse_busy)
    if args.instance:
        print(json.dumps(instance(json.loads(args.instance))))
        return

    sys.path.insert(0, str(HERE.parents[1] / "03_prefix_cache"))
    from transformers import AutoConfig

    from machine import cpu_name, load_average
    from mooncake_launcher import MooncakeClient, MooncakeMaster
    from vllm_from_scratch import default_model_dir

    model = args.model or default_model_dir()
    system, prompts = workload(AutoConfig.from_pretrained(model).vocab_size, args)
    base = dict(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        new_tokens=args.new_tokens,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        warm_up=args.warm_up,
    )
    print(
        f"{cpu_name()}; load average {load_average()}; {args.requests} requests sharing a {args.shared_len}-token "
        f"system prompt (+{args.distinct_len} own tokens), {args.new_tokens} new tokens each"
    )
    with MooncakeMaster() as master, MooncakeClient(master, segment_size="1 GB"):
        pool = {
            "kv_connector": "mooncake",
            "master_server_address": master.master_addr,
            "metadata_server": master.metadata_url,
            "global_segment_size": 0,
        }
        cold = run_instance({**base, "prompts": prompts})
        t0 = time.perf_counter()
        producer = run_instance(
            {**base, "prompts": [system + prompts[0][len(system) :]], "pool": {**pool, "kv_role": "kv_producer"}}
        )
        producer_s = time.perf_counter() - t0
        consumer = run_instance({**base, "prompts": prompts, "pool": {**pool, "kv_role": "kv_consumer"}})
        if args.pd:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                pd = prefill_decode(model, args, master, Path(tmp))
    num_same = sum(a == b for a, b in zip(cold["outputs"], consumer["outputs"]))
    print("\n| instance | TTFT mean s | TTFT p99 s | their prefill s | prompt tokens computed | loaded from the pool |")
    print("|---|---|---|---|---|---|")
    for name, r in (("cold (no pool)", cold), ("B (loads from the pool)", consumer)):
        loaded = r["pool"].get("kv_pool_loaded_blocks", 0)
        print(
            f"| {name} | {r['ttft_mean_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['prefill_s']:.2f} | "
            f"{r['prompt_tokens_computed']:,} of {r['prompt_tokens']:,} | {loaded} blocks, "
            f"{r['pool'].get('kv_pool_loaded_bytes', 0) / 2**20:.1f} MiB |"
        )
    print(
        f"greedy tokens identical in {num_same} of {args.requests} requests; "
        f"A published {producer['pool'].get('kv_pool_saved_blocks', 0)} blocks "
        f"(its process: {producer_s:.1f} s with start-up)"
    )
    pool = consumer["pool"]
    block_bytes = pool["kv_pool_loaded_bytes"] / max(pool["kv_pool_loaded_blocks"], 1)
    load_blocks_s = pool["kv_pool_loaded_blocks"] / max(pool["kv_pool_load_seconds"], 1e-9)
    prefill_tokens_s = cold["prompt_tokens_computed"] / cold["prefill_s"]
    print(
        f"break-even: one block is {block_bytes / 1024:.0f} KiB; loaded at {load_blocks_s:,.0f} blocks/s "
        f"({load_blocks_s * block_bytes / 2**20:,.0f} MiB/s), computed at {prefill_tokens_s:,.0f} prompt tokens/s "
        f"= {prefill_tokens_s / args.block_size:,.0f} blocks/s: loading is "
        f"{load_blocks_s / (prefill_tokens_s / args.block_size):.1f}x faster per block on this machine"
    )
    report = {
        "machine": {"cpu": cpu_name(), "load_average_after": load_average()},
        "args": vars(args),
        "cold": {k: v for k, v in cold.items() if k != "outputs"},
        "consumer": {k: v for k, v in consumer.items() if k != "outputs"},
        "producer": producer["pool"],
        "requests_with_identical_tokens": num_same,
    }
    if args.pd:
        report["prefill_decode"] = pd
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
