"""How much KV memory does paging save? Contiguous max-length reservation vs block tables.

Draws request lengths (prompt + output) from a seeded lognormal capped at ``max_model_len``, then
reserves KV memory for all of them two ways:

* contiguous: every request gets ``max_model_len`` slots up front (what a server that cannot grow
  a request's buffer must do);
* paged: every request gets ``ceil(len / block_size)`` blocks from a real :class:`BlockManager`,
  so only the last block of each request is partly empty.

It prints reserved vs used slots, the waste, the bytes for SmolLM2-135M's KV cache (30 layers,
3 KV heads of 64, bfloat16) and how many such requests fit at once in a fixed KV budget.

    python 01_paged_kv/demo.py
    python 01_paged_kv/demo.py --num-requests 2000 --plot waste.png
    python 01_paged_kv/demo.py --trace blocks.jsonl     # block tables in the real engine, traced
"""

from __future__ import annotations

import argparse

import torch

from block_manager import BlockManager, cdiv
from kv_cache import bytes_per_block, num_blocks_for_budget
from sequence import Sequence
from vllm_from_scratch.tools.viz import add_trace_argument

# SmolLM2-135M-Instruct, the book's default model.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 30, 3, 64, torch.bfloat16


def sample_lengths(num_requests: int, max_model_len: int, median: float, sigma: float, seed: int) -> list[int]:
    """Request lengths from a lognormal (long-tailed, like real chat traffic), clipped to [1, max_model_len]."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.log(torch.tensor(median))
    lengths = torch.exp(mu + sigma * torch.randn(num_requests, generator=g)).round().clamp(1, max_model_len)
    return [int(x) for x in lengths]


def paged_reserved_slots(lengths: list[int], block_size: int) -> int:
    """Allocate every request in a BlockManager and count the slots its blocks hold."""
    num_blocks = sum(cdiv(n, block_size) for n in lengths)
    bm = BlockManager(num_blocks, block_size)
    seqs = [Sequence([0] * n, block_size=block_size) for n in lengths]
    for seq in seqs:
        bm.allocate(seq)
    reserved = (bm.num_blocks - bm.get_num_free_blocks()) * block_size
    for seq in seqs:
        bm.free(seq)
    assert bm.all_blocks_free()
    return reserved


def build_rows(lengths: list[int], max_model_len: int, block_sizes: list[int], budget_gib: float) -> list[dict]:
    used = sum(lengths)
    mean_len = used / len(lengths)
    per_token = bytes_per_block(NUM_LAYERS, 1, NUM_KV_HEADS, HEAD_DIM, DTYPE)
    budget_tokens = num_blocks_for_budget(int(budget_gib * 2**30), NUM_LAYERS, 1, NUM_KV_HEADS, HEAD_DIM, DTYPE)
    rows = [
        dict(scheme=f"contiguous ({max_model_len})", reserved=len(lengths) * max_model_len, per_request=max_model_len)
    ]
    for bs in block_sizes:
        reserved = paged_reserved_slots(lengths, bs)
        rows.append(dict(scheme=f"paged, block {bs}", reserved=reserved, per_request=reserved / len(lengths)))
    for row in rows:
        row["waste_pct"] = 100.0 * (row["reserved"] - used) / row["reserved"]
        row["gib"] = row["reserved"] * per_token / 2**30
        # Requests of this mix that fit in the budget at once (average reservation per request).
        row["fit"] = int(budget_tokens // row["per_request"])
    rows.insert(
        0,
        dict(
            scheme="tokens actually used",
            reserved=used,
            per_request=mean_len,
            waste_pct=0.0,
            gib=used * per_token / 2**30,
            fit=int(budget_tokens // mean_len),
        ),
    )
    return rows


def print_table(rows: list[dict], budget_gib: float) -> None:
    header = f"{'scheme':<24}{'reserved slots':>16}{'waste %':>9}{'KV GiB':>9}{f'fit in {budget_gib:g} GiB':>14}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['scheme']:<24}{r['reserved']:>16,}{r['waste_pct']:>9.1f}{r['gib']:>9.2f}{r['fit']:>14,}")


def plot(rows: list[dict], lengths: list[int], max_model_len: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist(lengths, bins=60, color="tab:blue")
    ax1.axvline(max_model_len, color="tab:red", linestyle="--", label=f"max_model_len {max_model_len}")
    ax1.set(xlabel="request length (tokens)", ylabel="requests", title="length mix")
    ax1.legend()
    names = [r["scheme"] for r in rows]
    ax2.barh(names, [r["gib"] for r in rows], color=["tab:green"] + ["tab:red"] + ["tab:blue"] * (len(rows) - 2))
    ax2.invert_yaxis()
    ax2.set(xlabel="KV cache reserved (GiB, SmolLM2-135M bf16)", title="reserved KV memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def trace(path: str) -> None:
    """``--trace``: block tables in the real engine. Three chat requests on the default model
    (prefix caching off, so every block is a request's own); the third arrives one step later,
    after the first has crossed into its third block."""
    from vllm_from_scratch.tools.viz import Arrival, demo_trace

    demo_trace(
        path,
        [
            Arrival("Hi!", 24),
            Arrival("Explain paging in one sentence.", 24),
            Arrival("What is a KV cache?", 24, step=1),
        ],
        num_kvcache_blocks=24,
        max_model_len=256,
        enable_prefix_caching=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=1000, help="requests in the mix")
    parser.add_argument(
        "--max-model-len", type=int, default=4096, help="longest request; what a contiguous scheme reserves for each"
    )
    parser.add_argument("--median-len", type=float, default=400.0, help="median of the lognormal lengths")
    parser.add_argument("--sigma", type=float, default=1.0, help="sigma of the lognormal (its tail)")
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=[8, 16, 32, 256], help="one paged row per block size"
    )
    parser.add_argument("--budget-gib", type=float, default=2.0, help="KV budget for the 'fit' column")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length sampler")
    parser.add_argument("--plot", metavar="PNG", help="save a matplotlib figure here")
    add_trace_argument(parser)
    args = parser.parse_args()
    if args.trace:
        trace(args.trace)
        return
    if args.num_requests <= 0:
        parser.error("--num-requests must be positive")
    if args.max_model_len <= 0 or any(b <= 0 for b in args.block_sizes):
        parser.error("--max-model-len and --block-sizes must be positive")

    lengths = sample_lengths(args.num_requests, args.max_model_len, args.median_len, args.sigma, args.seed)
    print(
        f"{len(lengths)} requests, lengths lognormal(median {args.median_len:g}, sigma {args.sigma:g}) "
        f"capped at {args.max_model_len}: mean {sum(lengths) / len(lengths):.0f}, "
        f"max {max(lengths)}, seed {args.seed}"
    )
    per_token = bytes_per_block(NUM_LAYERS, 1, NUM_KV_HEADS, HEAD_DIM, DTYPE)
    print(
        f"KV bytes per token (SmolLM2-135M, {NUM_LAYERS} layers x {NUM_KV_HEADS} KV heads x {HEAD_DIM}, "
        f"bf16): {per_token:,}\n"
    )
    rows = build_rows(lengths, args.max_model_len, args.block_sizes, args.budget_gib)
    print_table(rows, args.budget_gib)
    paged_waste = max(r["reserved"] - rows[0]["reserved"] for r in rows[2:])
    print(
        f"\npaged waste is at most (block_size - 1) slots per request: "
        f"{paged_waste:,} <= {(max(args.block_sizes) - 1) * len(lengths):,}"
    )
    if args.plot:
        plot(rows, lengths, args.max_model_len, args.plot)


if __name__ == "__main__":
    main()
