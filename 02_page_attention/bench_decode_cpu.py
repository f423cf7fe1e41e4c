"""A decode step's attention on the compiled CPU kernel, against the memory it has to read.

One decode step of a model attends once per layer; each layer's keys and values are a different
part of the cache, so a step's K/V come from memory, not from the cache a single layer would fit
in. This times ``paged_attention_decode_cpu`` over ``--layers`` layers of cache (one query per
sequence, the default model's 9 query / 3 KV heads of 64, block size 16) and prints, in the same
run, a bare read of as many bytes (``torch.sum`` over one buffer) as the floor:

    .venv/bin/python 02_page_attention/bench_decode_cpu.py                       # 16 x 256-320 tokens
    .venv/bin/python 02_page_attention/bench_decode_cpu.py --seqs 1 --context 1500 1800
    .venv/bin/python 02_page_attention/bench_decode_cpu.py --blocks in-order --json out.json

``--blocks scattered`` (the default) gives every sequence blocks in a random order, as a serving
engine's free list does after a while; ``in-order`` gives each sequence consecutive blocks.
To compare two builds of the kernel, run this once per build (the kernel cache keeps both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

from machine import add_quiet_arg, check_quiet, machine_line
from paged_attention_cpu import cpu_kernel_available, paged_attention_decode_cpu


def decode_batch(args: argparse.Namespace) -> dict:
    """Queries, per-layer caches, block tables and lengths of one decode step, drawn with ``args.seed``."""
    generator = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    lo, hi = args.context
    lens = torch.randint(lo, hi + 1, (args.seqs,), generator=generator, dtype=torch.int32)
    max_blocks = -(-hi // args.block_size)
    num_blocks = args.seqs * max_blocks
    order = torch.randperm(num_blocks, generator=generator) if args.blocks == "scattered" else torch.arange(num_blocks)
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    return {
        "q": [
            torch.randn(args.seqs, args.q_heads, args.head_dim, generator=generator).to(dtype)
            for _ in range(args.layers)
        ],
        "k": [torch.randn(shape, generator=generator).to(dtype) for _ in range(args.layers)],
        "v": [torch.randn(shape, generator=generator).to(dtype) for _ in range(args.layers)],
        "block_tables": order.view(args.seqs, max_blocks).to(torch.int32),
        "lens": lens,
    }


def kv_bytes(batch: dict) -> int:
    """Bytes of keys and values a step reads: every sequence's tokens, every layer, K and V."""
    k = batch["k"][0]
    return int(batch["lens"].sum()) * k.shape[2] * k.shape[3] * k.element_size() * 2 * len(batch["k"])


def time_step(batch: dict, scale: float) -> float:
    """Seconds for one step: the kernel once per layer."""
    start = time.perf_counter()
    for q, k, v in zip(batch["q"], batch["k"], batch["v"]):
        paged_attention_decode_cpu(q, k, v, batch["block_tables"], batch["lens"], scale)
    return time.perf_counter() - start


def time_read(buffer: torch.Tensor) -> float:
    """Seconds for one ``sum`` over ``buffer``: the bytes a step reads, read as one stream."""
    start = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict:
    """Median step and read times over ``args.reps`` alternating repetitions, and their rates."""
    batch = decode_batch(args)
    nbytes = kv_bytes(batch)
    buffer = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    scale = args.head_dim**-0.5
    time_step(batch, scale)
    time_read(buffer)
    steps, reads = [], []
    for _ in tqdm(range(args.reps), desc="repetitions", disable=not args.progress):
        steps.append(time_step(batch, scale))
        reads.append(time_read(buffer))
    step, read = statistics.median(steps), statistics.median(reads)
    return {
        "kv_bytes": nbytes,
        "step_ms": step * 1e3,
        "step_gb_per_s": nbytes / step / 1e9,
        "read_ms": read * 1e3,
        "read_gb_per_s": nbytes / read / 1e9,
        "fraction_of_read": read / step,
    }


def report(args: argparse.Namespace, result: dict) -> str:
    """The run's shape, then one line each for the kernel and the bare read."""
    lo, hi = args.context
    return "\n".join(
        [
            f"decode attention: {args.seqs} sequences of {lo}-{hi} tokens, {args.q_heads} query / {args.kv_heads} KV "
            f"heads of {args.head_dim}, block size {args.block_size}, {args.blocks} blocks, {args.layers} layers, "
            f"{args.dtype}, {torch.get_num_threads()} threads, median of {args.reps}",
            f"  K and V read per step: {result['kv_bytes'] / 1e6:.1f} MB",
            f"  kernel:    {result['step_ms']:8.3f} ms a step  {result['step_gb_per_s']:6.1f} GB/s"
            f"  ({100 * result['fraction_of_read']:.0f} % of the bare read's rate)",
            f"  bare read: {result['read_ms']:8.3f} ms         {result['read_gb_per_s']:6.1f} GB/s",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=16, help="sequences in the batch (default 16)")
    parser.add_argument(
        "--context",
        type=int,
        nargs=2,
        default=(256, 320),
        metavar=("LO", "HI"),
        help="tokens per sequence, drawn in [LO, HI]",
    )
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--layers", type=int, default=30, help="layers of cache a step reads (default 30, the default model's)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--blocks", default="scattered", choices=["scattered", "in-order"])
    parser.add_argument("--reps", type=int, default=15, help="timed steps (default 15)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_quiet_arg(parser)
    args = parser.parse_args(argv)
    if args.q_heads % args.kv_heads:
        parser.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if not 1 <= args.context[0] <= args.context[1]:
        parser.error(f"--context must be 1 <= LO <= HI, got {args.context}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not cpu_kernel_available():
        raise SystemExit("the C++ kernel could not be built here; nothing to time")
    if args.threads:
        torch.set_num_threads(args.threads)
    check_quiet(args.refuse_busy)
    print(machine_line())
    result = measure(args)
    print(report(args, result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), "args": {k: v for k, v in vars(args).items()}, **result}, f, indent=1)


if __name__ == "__main__":
    main()
