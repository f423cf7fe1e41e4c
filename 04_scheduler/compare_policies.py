"""Two-phase (vLLM V1) versus prefill-first (nano-vllm) scheduling on one workload.

Both schedulers see the same requests, arriving over simulated time, and run on chapter 04's
fake model (``scheduler_testing.FakeModel``: deterministic tokens, a checked fake KV cache).
Time is a *latency proxy*: a step costs ``--step-overhead-ms + --per-token-ms x tokens``, the
shape of a real forward on a GPU (a fixed cost to stream the weights, plus work per token).
Arrivals that fall inside a step wait for the next one.

Printed per policy: steps, mean tokens per step, simulated makespan, time to first token
(mean, p99), inter-token latency (p50, p99, max) and preemptions. Both policies must produce
identical tokens (the script checks it).

    python 04_scheduler/compare_policies.py
"""

from __future__ import annotations

import argparse
import random

from block_manager import BlockManager
from prefill_first import PrefillFirstScheduler
from scheduler import Request, Scheduler
from scheduler_testing import FakeModel


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def make_workload(args) -> list[tuple[float, list[int], int]]:
    """(arrival ms, prompt, max_tokens) for every request, from ``args.seed``."""
    rng = random.Random(args.seed)
    t, reqs = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(1.0 / args.mean_gap_ms)
        prompt = [rng.randrange(1, args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        reqs.append((t, prompt, rng.randint(args.min_out, args.max_out)))
    return reqs


def simulate(sched_cls, args) -> dict:
    bm = BlockManager(args.num_blocks, args.block_size)
    sched = sched_cls(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=args.num_blocks,
        block_size=args.block_size,
        block_manager=bm,
    )
    model = FakeModel(bm, args.vocab)
    pending = list(enumerate(make_workload(args)))
    reqs: dict[str, Request] = {}
    token_times: dict[str, list[float]] = {}
    clock, steps, tokens = 0.0, 0, 0
    while pending or sched.has_requests():
        if not sched.has_requests() and pending[0][1][0] > clock:
            clock = pending[0][1][0]  # idle until the next arrival
        while pending and pending[0][1][0] <= clock:
            i, (arrival, prompt, max_tokens) = pending.pop(0)
            req = Request(
                f"r{i}",
                prompt,
                max_tokens=max_tokens,
                arrival_time=arrival,
                ignore_eos=True,
                block_size=args.block_size,
            )
            reqs[req.request_id] = req
            token_times[req.request_id] = []
            sched.add_request(req)
        out = sched.schedule()
        sampled = model.execute(out)
        clock += args.step_overhead_ms + args.per_token_ms * out.total_num_scheduled_tokens
        steps += 1
        tokens += out.total_num_scheduled_tokens
        for rid in sampled:
            token_times[rid].append(clock)
        sched.update_from_output(out, sampled)
    ttft = [token_times[r][0] - reqs[r].arrival_time for r in reqs]
    itl = [b - a for r in reqs for a, b in zip(token_times[r], token_times[r][1:])]
    return dict(
        steps=steps,
        tok_per_step=tokens / steps,
        makespan=clock,
        ttft_mean=sum(ttft) / len(ttft),
        ttft_p99=percentile(ttft, 99),
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
        itl_max=max(itl, default=float("nan")),
        preemptions=sched.num_preemptions,
        outputs={r: reqs[r].completion_token_ids for r in reqs},
    )


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--mean-gap-ms", type=float, default=80.0, help="mean time between arrivals")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-out", type=int, default=16)
    p.add_argument("--max-out", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--step-overhead-ms", type=float, default=10.0)
    p.add_argument("--per-token-ms", type=float, default=0.05)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    rows = [
        ("two-phase (vLLM V1)", simulate(Scheduler, args)),
        ("prefill-first (nano-vllm)", simulate(PrefillFirstScheduler, args)),
    ]
    assert rows[0][1]["outputs"] == rows[1][1]["outputs"], "the policies produced different tokens"
    print(
        f"{args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, outputs "
        f"{args.min_out}-{args.max_out}, mean gap {args.mean_gap_ms} ms; step = "
        f"{args.step_overhead_ms} ms + {args.per_token_ms} ms/token (simulated)"
    )
    head = (
        "policy",
        "steps",
        "tok/step",
        "makespan s",
        "TTFT mean ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "ITL max ms",
        "preempt",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, r in rows:
        print(
            f"| {name} | {r['steps']} | {r['tok_per_step']:.1f} | {r['makespan'] / 1000:.2f} | "
            f"{r['ttft_mean']:.0f} | {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} | {r['itl_p99']:.1f} | "
            f"{r['itl_max']:.1f} | {r['preemptions']} |"
        )
    return [dict(r, policy=name) for name, r in rows]


if __name__ == "__main__":
    main()
