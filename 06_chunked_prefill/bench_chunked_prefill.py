"""What chunked prefill is for: decoding requests keep their pace while a long prompt arrives.

A few requests are decoding on the toy transformer (real matmuls, so a forward's time grows with
its tokens) when a long prompt arrives. Without chunking, the whole prompt runs in one step and
every decoding request waits for it: one very long inter-token gap. With chunking, the prompt
goes through in ``--chunk``-token pieces next to the decodes: the gaps stay short, and the long
prompt's time to first token grows a little (it shares steps, and each chunk re-reads the cached
part of the prompt).

Wall-clock times on this machine, measured around ``schedule() + forward + update``; each mode
runs ``--repeats`` times (alternating) and the table shows medians. Also saves a plot.

    python 06_chunked_prefill/bench_chunked_prefill.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from chunked_prefill import ChunkedPrefillScheduler
from chunked_toy_model import ToyRunner, ToyTransformer
from machine import add_quiet_arg, check_quiet, load_average, machine_line
from scheduler import Request, Scheduler


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def run_once(model: ToyTransformer, args, chunked: bool) -> dict:
    bs = args.block_size
    need = args.long_prompt + args.decode_prompt * args.num_decoders + args.max_tokens * (args.num_decoders + 1)
    num_blocks = 2 * (need // bs + args.num_decoders + 2)
    if chunked:
        sched = ChunkedPrefillScheduler(args.num_decoders + 1, args.chunk, num_blocks, block_size=bs)
    else:
        sched = Scheduler(args.num_decoders + 1, args.long_prompt + 64, num_blocks, block_size=bs)
    runner = ToyRunner(model, num_blocks, bs)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = lambda n: torch.randint(1, model.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    decoders = [
        Request(f"d{i}", prompt(args.decode_prompt), max_tokens=args.max_tokens, ignore_eos=True, block_size=bs)
        for i in range(args.num_decoders)
    ]
    long_req = Request("long", prompt(args.long_prompt), max_tokens=8, ignore_eos=True, block_size=bs)
    for r in decoders:
        sched.add_request(r)
    times: dict[str, list[float]] = {r.request_id: [] for r in decoders + [long_req]}
    t0 = time.perf_counter()
    arrival, step = None, 0
    while sched.has_requests() or step <= args.arrive_step:
        if step == args.arrive_step:
            sched.add_request(long_req)
            arrival = time.perf_counter() - t0
        out = sched.schedule()
        sampled = runner.execute(out)
        sched.update_from_output(out, sampled)
        now = time.perf_counter() - t0
        for rid in sampled:
            times[rid].append(now)
        step += 1
    itl = [b - a for r in decoders for a, b in zip(times[r.request_id], times[r.request_id][1:])]
    return dict(
        ttft=times["long"][0] - arrival,
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
        itl_max=max(itl),
        steps=step,
        total=time.perf_counter() - t0,
        arrival=arrival,
        d0_times=times["d0"],
        long_first=times["long"][0],
    )


def plot(results: dict[str, dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for (name, r), color in zip(results.items(), ("tab:red", "tab:blue")):
        t = r["d0_times"]
        # Each gap is drawn over the interval it spans: a flat line is a wait.
        ax.step(
            [x * 1e3 for x in t],
            [(t[1] - t[0]) * 1e3] + [(b - a) * 1e3 for a, b in zip(t, t[1:])],
            where="pre",
            color=color,
            label=f"{name}: gap between d0's tokens",
        )
        ax.axvline(
            r["long_first"] * 1e3,
            color=color,
            ls="--",
            lw=1,
            label=f"{name}: long prompt's first token (TTFT {r['ttft'] * 1e3:.0f} ms)",
        )
    ax.axvline(results["no chunking"]["arrival"] * 1e3, color="gray", ls=":", lw=1, label="long prompt arrives")
    ax.set_xlabel("time since start (ms)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_yscale("log")
    ax.set_title(
        f"{args.num_decoders} decoding requests, a {args.long_prompt}-token prompt arrives (chunks of {args.chunk})"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--num-decoders", type=int, default=4)
    p.add_argument("--decode-prompt", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=40, help="tokens each decoding request generates")
    p.add_argument("--long-prompt", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens with chunking")
    p.add_argument("--arrive-step", type=int, default=10, help="step at which the long prompt arrives")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="also draw the latency plot to PATH")
    add_quiet_arg(p)
    args = p.parse_args(argv)
    check_quiet(args.refuse_busy)
    torch.set_num_threads(args.threads)

    model = ToyTransformer(
        vocab_size=1024,
        hidden=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        seed=args.seed,
    )
    modes = {"no chunking": False, f"chunked ({args.chunk})": True}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    run_once(
        model, argparse.Namespace(**{**vars(args), "long_prompt": 64, "max_tokens": 4, "arrive_step": 2}), False
    )  # warm-up
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for name, chunked in modes.items():
            runs[name].append(run_once(model, args, chunked))
    print(
        f"toy model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads; {args.num_decoders} "
        f"decoding requests; a {args.long_prompt}-token prompt arrives at step {args.arrive_step}; "
        f"medians of {args.repeats} runs; torch {torch.__version__}\n{machine_line()}; load average {load_average()}"
    )
    head = (
        "mode",
        "steps",
        "long prompt TTFT ms",
        "decode ITL p50 ms",
        "decode ITL p99 ms",
        "decode ITL max ms",
        "total s",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    summary = {}
    for name, rs in runs.items():
        med = {
            k: statistics.median(r[k] for r in rs) for k in ("ttft", "itl_p50", "itl_p99", "itl_max", "total", "steps")
        }
        summary[name] = med
        print(
            f"| {name} | {med['steps']:.0f} | {med['ttft'] * 1e3:.0f} | {med['itl_p50'] * 1e3:.1f} | "
            f"{med['itl_p99'] * 1e3:.1f} | {med['itl_max'] * 1e3:.1f} | {med['total']:.2f} |"
        )
    if args.plot:
        plot(
            {"no chunking": runs["no chunking"][-1], "chunked": runs[f"chunked ({args.chunk})"][-1]},
            args.plot,
            args,
        )
        print(f"plot: {args.plot}")
    return summary


if __name__ == "__main__":
    main()
