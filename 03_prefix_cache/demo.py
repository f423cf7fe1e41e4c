"""Chapter 03 demo: a shared system prompt, served by the local prefix cache and a global KV pool.

Part 1 (one engine): many requests share a long system prompt and differ in a short user
suffix. The prefix-caching block manager computes the system prompt once; the demo prints the
hit rate and the prefill tokens saved.

Part 2 (two engine processes): engine A serves the first half of the requests and publishes
its full blocks to a Mooncake store (started here, on loopback); engine B, a separate process
with a cold local cache, serves the second half and loads the system prompt's K/V from the
store instead of computing it. B's K/V is checked against a fresh computation. Without Mooncake
the same runs on the embedded in-process pool, with a note.

    python 03_prefix_cache/demo.py
    python 03_prefix_cache/demo.py --trace prefix.jsonl   # shared prefix blocks in the real engine, traced
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import warnings

import torch

from vllm_from_scratch.tools.viz import add_trace_argument


def workload(num_requests: int, system_len: int, seed: int = 0) -> list[list[int]]:
    from kv_pool_peer import prompt_tokens

    system = prompt_tokens(seed, system_len)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(8, 48, (num_requests,), generator=g).tolist()
    return [system + prompt_tokens(seed + 100 + i, n) for i, n in enumerate(lengths)]


def serve(engine, prompts: list[list[int]]) -> dict:
    """Prefill every prompt, check its cached K/V against a fresh computation, free it."""
    exact = True
    for prompt in prompts:
        seq = engine.prefill(prompt)
        exact &= torch.equal(engine.gather_kv(seq), engine.model.compute_kv(prompt))
        engine.finish(seq)
    bm = engine.block_manager
    return {
        "prompt_tokens": sum(map(len, prompts)),
        "from_local": engine.tokens_from_local,
        "from_pool": engine.tokens_from_pool,
        "computed": engine.tokens_computed,
        "hit_rate": bm.hit_rate,
        "exact": exact,
        "all_free": bm.all_blocks_free(),
    }


def print_row(name: str, r: dict) -> None:
    saved = r["from_local"] + r["from_pool"]
    print(
        f"{name:<10}{r['prompt_tokens']:>9}{r['from_local']:>12}{r['from_pool']:>11}{r['computed']:>10}"
        f"{saved / r['prompt_tokens']:>9.1%}{r['hit_rate']:>10.1%}   {'yes' if r['exact'] else 'NO'}"
    )


HEADER = (
    f"{'engine':<10}{'prompt':>9}{'local hit':>12}{'pool hit':>11}{'computed':>10}"
    f"{'saved':>9}{'hit rate':>10}   K/V exact"
)


def engine_process(backend_spec: dict, prompts: list[list[int]], reserved_blocks: int, results) -> None:
    """One engine in its own process: connect to the pool, serve ``prompts``, report."""
    from global_kv_pool import GlobalKVPool, MooncakeKVPool
    from kv_pool_peer import MiniEngine

    warnings.simplefilter("ignore")
    backend = MooncakeKVPool(backend_spec["master_addr"], backend_spec["metadata_url"], global_segment_size=0)
    pool = GlobalKVPool(backend, namespace="demo-toy-model", block_size=backend_spec["block_size"])
    engine = MiniEngine(
        pool,
        num_blocks=backend_spec["num_blocks"],
        block_size=backend_spec["block_size"],
        reserved_blocks=reserved_blocks,
    )
    report = serve(engine, prompts)
    engine.close()
    report["published"] = pool.num_published
    results.put(report)
    backend.close()


def run_two_processes(first: list[list[int]], second: list[list[int]], args) -> tuple[dict, dict]:
    from mooncake_launcher import MooncakeClient, MooncakeMaster

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with MooncakeMaster() as master, MooncakeClient(master, segment_size="128 MB"):
        spec = {
            "master_addr": master.master_addr,
            "metadata_url": master.metadata_url,
            "block_size": args.block_size,
            "num_blocks": args.num_blocks,
        }
        reports = []
        for prompts, reserved in ((first, 0), (second, 7)):  # A, then B after A has exited
            proc = ctx.Process(target=engine_process, args=(spec, prompts, reserved, results))
            proc.start()
            reports.append(results.get(timeout=120))
            proc.join(timeout=60)
    return reports[0], reports[1]


def run_embedded(first: list[list[int]], second: list[list[int]], args) -> tuple[dict, dict]:
    from global_kv_pool import EmbeddedKVPool, GlobalKVPool
    from kv_pool_peer import MiniEngine

    pool = GlobalKVPool(EmbeddedKVPool(), namespace="demo-toy-model", block_size=args.block_size)
    reports = []
    for prompts, reserved in ((first, 0), (second, 7)):
        engine = MiniEngine(pool, num_blocks=args.num_blocks, block_size=args.block_size, reserved_blocks=reserved)
        reports.append(serve(engine, prompts))
        engine.close()
    return reports[0], reports[1]


def trace(path: str) -> None:
    """``--trace``: four chat requests on the default model share a system prompt and arrive
    two steps apart; each later one finds the prompt's blocks in the prefix cache and shares
    them (reference counts above 1)."""
    from vllm_from_scratch.tools.viz import Arrival, demo_trace

    system = (
        "You are a patient teacher of computer science. You explain ideas to students who are new to "
        "them, in plain words, with one small example when it helps. Answer in one short sentence."
    )
    questions = ["What is the capital of France?", "What is 2 + 2?", "Name a planet.", "What colour is the sky?"]
    demo_trace(
        path,
        [Arrival(q, 8, step=2 * i, system=system) for i, q in enumerate(questions)],
        num_kvcache_blocks=32,
        max_model_len=256,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Prefix caching on a shared-system-prompt workload, locally "
        "and across two engine processes through a Mooncake store."
    )
    ap.add_argument("--requests", type=int, default=32, help="number of requests")
    ap.add_argument("--system-len", type=int, default=400, help="tokens of the shared system prompt")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=128, help="KV blocks per engine")
    ap.add_argument("--embedded", action="store_true", help="use the in-process pool even if Mooncake works")
    add_trace_argument(ap)
    args = ap.parse_args()
    if args.trace:
        trace(args.trace)
        return
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's C++ info logs would drown the table
    from kv_pool_peer import MiniEngine
    from mooncake_launcher import mooncake_unavailable_reason

    prompts = workload(args.requests, args.system_len)
    print(
        f"workload: {args.requests} requests = one {args.system_len}-token system prompt + "
        f"a 8-47-token user suffix; block size {args.block_size}\n"
    )

    print("1) one engine, local prefix cache (PrefixCachingBlockManager)")
    print(HEADER)
    t0 = time.perf_counter()
    local = serve(MiniEngine(None, num_blocks=args.num_blocks, block_size=args.block_size), prompts)
    print_row("local", local)
    print(f"   every block back in the free queue: {local['all_free']}   ({time.perf_counter() - t0:.2f} s)\n")

    half = len(prompts) // 2
    reason = None if args.embedded else mooncake_unavailable_reason()
    if args.embedded or reason:
        print(f"2) two engines through the EMBEDDED pool (note: {reason or '--embedded given'})")
        run = run_embedded
    else:
        print(
            "2) two engine processes through a Mooncake store (mooncake_master + mooncake_client "
            f"on loopback);\n   A serves requests 1..{half} and exits, then B serves the rest with a cold local cache"
        )
        run = run_two_processes
    t0 = time.perf_counter()
    a, b = run(prompts[:half], prompts[half:], args)
    print(HEADER)
    print_row("A", a)
    print_row("B", b)
    print(f"   B loaded {b['from_pool']} tokens of K/V that A computed ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
