"""Chapter 02 demo: attention over a paged KV cache whose blocks are shuffled.

1. A few sequences of uneven lengths are written into randomly chosen physical blocks (every other
   slot holds large garbage), and their block tables are printed.
2. Decode (one new token each) and prefill with cached context (several new tokens after earlier
   ones) are computed four ways: the torch paths, the Triton kernels (Triton's interpreter on a
   CPU), the compiled C++ CPU kernels (where they build), and dense attention on the
   contiguous K/V; the largest differences are printed.
3. Timing tables: the torch decode path (one gather + one batched attention call) against a naive
   loop that attends one sequence at a time and against the C++ kernel, and the torch varlen
   path against the C++ one on prefill / chunked / mixed batches.

Run: ``python 02_page_attention/demo.py`` (a few seconds on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F

# Part 2 runs the Triton kernels; without a GPU only Triton's interpreter can. Triton reads this
# variable when a kernel is defined, i.e. when its module is imported, so it must be set here,
# before the imports below; the book's modules only read it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_backends import select_backend  # noqa: E402
from block_manager import cdiv  # noqa: E402
from machine import add_quiet_arg, check_quiet, load_average, machine_line  # noqa: E402
from paged_attention import dense_attention_reference, paged_attention_decode, paged_attention_varlen  # noqa: E402
from paged_attention_cpu import (  # noqa: E402
    cpu_kernel_available,
    paged_attention_decode_cpu,
    paged_attention_varlen_cpu,
)
from paged_attention_triton import paged_attention_decode_triton, paged_attention_varlen_triton  # noqa: E402
from triton_setup import INTERPRETED, KERNEL_DEVICE  # noqa: E402


def build_paged_cache(kv_lens, num_kv_heads, head_dim, block_size, generator, spare_blocks=4):
    """Write random K/V of each sequence into shuffled physical blocks; garbage everywhere else.

    Returns ``k_cache, v_cache, block_tables (padded with -1), [k per sequence], [v per sequence]``.
    """
    blocks_per_seq = [cdiv(n, block_size) for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator) * 100
    v_cache = torch.randn(shape, generator=generator) * 100
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables, ks, vs = [], [], []
    for n, nb in zip(kv_lens, blocks_per_seq):
        table = [free.pop() for _ in range(nb)]
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        tables.append(table)
        ks.append(k)
        vs.append(v)
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables, ks, vs


def on_kernel_device(kernel, *args):
    """A Triton wrapper called where its kernel runs (CPU tensors interpreted, CUDA ones compiled);
    the result comes back to the CPU to be compared."""
    return kernel(*(a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args)).cpu()


def show_correctness(args, g):
    hq, hkv, d, bs = 8, 2, 32, args.block_size
    kv_lens = [5, 16, 17, 38]
    k_cache, v_cache, bt, ks, vs = build_paged_cache(kv_lens, hkv, d, bs, g)
    print(
        f"Paged cache: {k_cache.shape[0]} physical blocks of {bs} slots, {hq} q heads over {hkv} kv heads "
        f"(GQA {hq // hkv}:1), head_dim {d}"
    )
    for b, n in enumerate(kv_lens):
        table = [x for x in bt[b].tolist() if x >= 0]
        print(f"  seq {b}: {n:>2} tokens -> block table {table}")
    scale = d**-0.5
    lens = torch.tensor(kv_lens, dtype=torch.int32)

    q = torch.randn(len(kv_lens), hq, d, generator=g)
    dense = torch.cat([dense_attention_reference(q[b : b + 1], ks[b], vs[b], scale=scale) for b in range(len(kv_lens))])
    decode = {
        "torch": paged_attention_decode(q, k_cache, v_cache, bt, lens, scale),
        "triton": on_kernel_device(paged_attention_decode_triton, q, k_cache, v_cache, bt, lens, scale),
    }

    q_lens = [5, 3, 17, 6]  # seq 0 is a fresh prompt; the others have cached context before these
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    qv = torch.randn(sum(q_lens), hq, d, generator=g)
    dense_v = torch.cat(
        [dense_attention_reference(qv[cu[b] : cu[b + 1]], ks[b], vs[b], scale=scale) for b in range(len(kv_lens))]
    )
    varlen = {
        "torch": paged_attention_varlen(qv, k_cache, v_cache, cu, lens, bt, scale),
        "triton": on_kernel_device(paged_attention_varlen_triton, qv, k_cache, v_cache, cu, lens, bt, scale),
    }
    if cpu_kernel_available():
        decode["C++"] = paged_attention_decode_cpu(q, k_cache, v_cache, bt, lens, scale)
        varlen["C++"] = paged_attention_varlen_cpu(qv, k_cache, v_cache, cu, lens, bt, scale)

    triton_mode = "interpreter" if INTERPRETED else "GPU"
    print(f"\nMax |paged - dense| (float32; Triton runs in its {triton_mode}; C++ is the compiled kernels):")
    print(f"  {'path':<34}" + "".join(f" {name:>10}" for name in decode))
    print(
        f"  {'decode (1 new token, 4 seqs)':<34}"
        + "".join(f" {(o - dense).abs().max():>10.2e}" for o in decode.values())
    )
    print(
        f"  {'prefill, new tokens ' + str(q_lens):<34}"
        + "".join(f" {(o - dense_v).abs().max():>10.2e}" for o in varlen.values())
    )
    print("  (the garbage in unused slots has magnitude ~100: reading one slot of it would show as an error >> 1)")
    print(f"  paged_attention(backend='auto') on these CPU tensors runs: {select_backend(q, k_cache)}")


def naive_decode_loop(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One sequence at a time: gather its blocks, attend, next. What batching replaces."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for b, n in enumerate(context_lens.tolist()):
        table = block_tables[b, : cdiv(n, bs)].long()
        k = k_cache[table].flatten(0, 1)[:n].transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[table].flatten(0, 1)[:n].transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b][:, None], k, v, scale=scale, enable_gqa=True)[:, 0]
    return out


def time_it(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def show_timing(args, g):
    hq, hkv, d, bs = 9, 3, 64, 16  # SmolLM2-135M's attention shape, the engine's default block size
    print(
        f"\nDecode timing, torch, float32, torch threads {torch.get_num_threads()}, "
        f"{hq} q / {hkv} kv heads, head_dim {d}, "
        f"block_size {bs}, contexts uniform in [{args.context_len // 2}, {args.context_len}] "
        f"(median of {args.repeats}):\n  {machine_line()}; load average {load_average()}"
    )
    cpp = cpu_kernel_available()
    print(
        f"  {'batch':>5} {'batched (ms)':>13} {'per-seq loop (ms)':>18} {'speed-up':>9}"
        + (f" {'C++ kernel (ms)':>16} {'speed-up':>9}" if cpp else "")
        + f" {'max |diff|':>11}"
    )
    for batch in args.batch_sizes:
        kv_lens = torch.randint(args.context_len // 2, args.context_len + 1, (batch,), generator=g).tolist()
        k_cache, v_cache, bt, _, _ = build_paged_cache(kv_lens, hkv, d, bs, g)
        q = torch.randn(batch, hq, d, generator=g)
        lens = torch.tensor(kv_lens, dtype=torch.int32)
        inputs = (q, k_cache, v_cache, bt, lens, d**-0.5)
        batched = time_it(functools.partial(paged_attention_decode, *inputs), args.repeats)
        loop = time_it(functools.partial(naive_decode_loop, *inputs), args.repeats)
        reference = naive_decode_loop(q, k_cache, v_cache, bt, lens, d**-0.5)
        diff = (paged_attention_decode(q, k_cache, v_cache, bt, lens, d**-0.5) - reference).abs().max()
        row = f"  {batch:>5} {batched * 1e3:>13.3f} {loop * 1e3:>18.3f} {loop / batched:>8.1f}x"
        if cpp:
            kernel = time_it(functools.partial(paged_attention_decode_cpu, *inputs), args.repeats)
            diff = max(
                diff, (paged_attention_decode_cpu(q, k_cache, v_cache, bt, lens, d**-0.5) - reference).abs().max()
            )
            row += f" {kernel * 1e3:>16.3f} {batched / kernel:>8.1f}x"
        print(row + f" {diff:>11.1e}")


def show_varlen_timing(args, g):
    """The varlen path on the batches chapter 06 builds: whole prompts, chunks after cached
    context, and chunks with decode rows riding along."""
    hq, hkv, d, bs = 9, 3, 64, 16
    cases = [
        ("fresh prompt", [(256, 256)]),
        ("chunk after context", [(128, 512)]),
        ("chunk + 32 decodes", [(128, 512)] + [(1, args.context_len)] * 32),
        ("4 prompts", [(64, 64), (96, 96), (128, 128), (32, 32)]),
        ("8 prompts of 256", [(256, 256)] * 8),
    ]
    cpp = cpu_kernel_available()
    print(f"\nVarlen timing, float32, same shape (median of {args.repeats}); (new, total) tokens per sequence:")
    print(
        f"  {'batch':<22} {'sequences':>9} {'new tokens':>10} {'keys read':>10} {'torch (ms)':>10}"
        + (f" {'C++ kernel (ms)':>16} {'speed-up':>9}" if cpp else "")
        + f" {'max |err|':>10}"
    )
    for name, shapes in cases:
        q_lens, kv_lens = [s[0] for s in shapes], [s[1] for s in shapes]
        k_cache, v_cache, bt, ks, vs = build_paged_cache(kv_lens, hkv, d, bs, g)
        q = torch.randn(sum(q_lens), hq, d, generator=g)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        lens = torch.tensor(kv_lens, dtype=torch.int32)
        inputs = (q, k_cache, v_cache, cu, lens, bt, d**-0.5)
        runs = [functools.partial(paged_attention_varlen, *inputs)]
        if cpp:
            runs.append(functools.partial(paged_attention_varlen_cpu, *inputs))
        elapsed = [time_it(run, args.repeats) for run in runs]
        err = max(
            (run()[cu[b] : cu[b + 1]] - dense_attention_reference(q[cu[b] : cu[b + 1]], ks[b], vs[b], scale=d**-0.5))
            .abs()
            .max()
            .item()
            for run in runs
            for b in range(len(shapes))
        )
        row = f"  {name:<22} {len(shapes):>9} {sum(q_lens):>10} {sum(kv_lens):>10} {elapsed[0] * 1e3:>10.3f}"
        if cpp:
            row += f" {elapsed[1] * 1e3:>16.3f} {elapsed[0] / elapsed[1]:>8.1f}x"
        print(row + f" {err:>10.1e}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--block-size", type=int, default=8, help="slots per block in the correctness part")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64], help="timing table rows")
    parser.add_argument("--context-len", type=int, default=256, help="longest context in the timing table")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per row (median reported)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 keeps timings steady on a shared 2-core machine)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_quiet_arg(parser)
    args = parser.parse_args()
    check_quiet(args.refuse_busy)
    for name in ("block_size", "context_len", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.batch_sizes):
        parser.error("--batch-sizes must all be >= 1")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    show_correctness(args, g)
    show_timing(args, g)
    show_varlen_timing(args, g)


if __name__ == "__main__":
    main()
