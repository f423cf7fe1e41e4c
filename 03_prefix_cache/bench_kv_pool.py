"""Throughput of the global KV pool's backends for one KV block, on this machine.

Times, per backend: the raw store (``put_many`` / ``get_many`` / ``exists_many`` of already
serialized values, one key per call and 32 keys per call), and ``GlobalKVPool.publish`` /
``fetch`` (which add serialization, validation and the copy into the paged cache). The default
block is SmolLM2-135M's: 30 layers x 16 tokens x 3 KV heads x 64 dims x K and V in bfloat16 =
360 KiB. Mooncake runs on loopback TCP with a master and a mooncake_client started here.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

from global_kv_pool import EmbeddedKVPool, GlobalKVPool, MooncakeKVPool, serialize_block
from machine import add_quiet_arg, check_quiet, load_average, machine_line
from mooncake_launcher import MooncakeClient, MooncakeMaster, mooncake_unavailable_reason
from prefix_cache_local import hash_block_chain


def timed(fn, repeat: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn(0)
    t0 = time.perf_counter()
    for i in range(1, repeat + 1):
        fn(i)
    return (time.perf_counter() - t0) / repeat


def bench_backend(backend, args, block_bytes: int) -> list[tuple[str, float, int]]:
    """Rows of (operation, seconds per call, blocks per call)."""
    n = args.repeat
    shape = (2, args.layers, args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
    kv_cache = torch.randn(shape).to(getattr(torch, args.dtype))
    tokens = list(range(args.block_size))
    value = serialize_block(kv_cache[:, :, 0], tuple(tokens))
    keys = [f"bench/{os.getpid()}/{i}" for i in range(n + 33)]
    rows = [
        ("put 1", timed(lambda i: backend.put_many({keys[i]: value}), n), 1),
        ("get 1", timed(lambda i: backend.get_many([keys[i]]), n), 1),
        ("exists 1", timed(lambda i: backend.exists_many([keys[i]]), n), 1),
        ("get_many 32", timed(lambda i: backend.get_many(keys[:32]), max(1, n // 8)), 32),
    ]
    pool = GlobalKVPool(backend, namespace=f"bench{os.getpid()}", block_size=args.block_size)
    chains = [hash_block_chain([i] * args.block_size, args.block_size) for i in range(n + 1)]
    rows.append(
        (
            "publish 1 (+serialize)",
            timed(lambda i: pool.publish(chains[i], [(i,) * args.block_size], kv_cache, [i % args.num_blocks]), n),
            1,
        )
    )
    rows.append(
        (
            "fetch 1 (+validate, copy)",
            timed(lambda i: pool.fetch(chains[i], [(i,) * args.block_size], kv_cache, [0]), n),
            1,
        )
    )
    assert pool.num_faults == 0, "a benchmark fetch fell back to recompute"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200, help="calls per measurement")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=8, help="blocks in the benchmark's paged cache")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; copying one block is too small to split, and on a "
        "busy 2-core machine extra threads only wait on each other",
    )
    add_quiet_arg(ap)
    args = ap.parse_args()
    check_quiet(args.refuse_busy)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOG_minloglevel", "2")
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    block_bytes = 2 * args.layers * args.block_size * args.kv_heads * args.head_dim * itemsize
    print(
        f"one block = {block_bytes / 1024:.0f} KiB ({args.layers} layers, {args.block_size} tokens, "
        f"{args.kv_heads} KV heads x {args.head_dim}, {args.dtype})\n{machine_line()}; load average {load_average()}"
    )

    results = {}
    backends = ["embedded"] + ([] if mooncake_unavailable_reason() else ["mooncake"])
    for name in tqdm(backends, desc="backends"):
        if name == "embedded":
            results[name] = bench_backend(EmbeddedKVPool(4 << 30), args, block_bytes)
            continue
        with MooncakeMaster() as master, MooncakeClient(master, segment_size="1 GB"):
            backend = MooncakeKVPool(
                master.master_addr, master.metadata_url, global_segment_size=0, local_buffer_size=256 << 20
            )
            try:
                results[name] = bench_backend(backend, args, block_bytes)
            finally:
                backend.close()
    if len(backends) == 1:
        print(f"(Mooncake skipped: {mooncake_unavailable_reason()})")

    print(f"\n{'operation':<28}" + "".join(f"{b + ' blocks/s':>22}{'MiB/s':>11}" for b in backends))
    for i, (op, _, _) in enumerate(results["embedded"]):
        cells = []
        for b in backends:
            _, sec, blocks = results[b][i]
            mib = "-" if op.startswith("exists") else f"{blocks * block_bytes / sec / 2**20:,.0f}"
            cells.append(f"{blocks / sec:>22,.0f}{mib:>11}")
        print(f"{op:<28}" + "".join(cells))


if __name__ == "__main__":
    main()
