"""The steps of ``07_engine/gpu_check.sh``, one subcommand each, each run in a process of its own
by ``gpu_check.py`` (so that one crash or hang costs one step, not the run).

* ``versions OUT``: library versions, the card, nvidia-smi, and where each package was imported from;
* ``checkpoint DIR``: the Qwen3-0.6B-shaped random checkpoint and its tokenizer (bench.py's), once;
* ``kernels OUT``: the Triton paged-attention kernels (decode and varlen), the Triton
  ``store_kvcache`` and the Triton rejection sampler against their torch references, at the
  engine's shapes (Qwen3-0.6B's heads, block sizes 16 and 256, its 151,936-token vocabulary);
* ``parity DIR OUT``: the engine's greedy tokens against transformers' ``generate``;
* ``decode DIR OUT``: the decode step at batch 1 and 64 against the card's weight-streaming
  floor, a profiler table of one eager decode step, and peak memory against the KV budget.

``--dry-run`` runs each on the CPU at tiny sizes: what a machine without CUDA can check.
Exit status 0: done; 77: skipped, the reason on the last line; anything else: failed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SKIPPED = 77
# HBM bandwidth (bytes/s) of the cards this kit expects; the floor is only computed for these.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}
# A CPU dry run shrinks the checkpoint to this (bench.make_qwen3_06b_shaped's overrides).
TINY_QWEN3 = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
PACKAGES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "xxhash", "flash_attn")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def hbm_bandwidth(device_name: str) -> float | None:
    """Bytes/s of the card named ``device_name`` (torch.cuda.get_device_name), None if unknown."""
    for key, bandwidth in HBM_BANDWIDTH.items():  # "H100 PCIe" before the plain "H100"
        if all(word in device_name for word in key.split()):
            return bandwidth
    return None


# ---------------------------------------------------------------------------------- versions
def versions(out: Path) -> None:
    """Versions of python and every package the kit may use, the card, nvidia-smi's report."""
    info: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "packages": {}}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            info["packages"][name] = {"version": getattr(module, "__version__", "?"), "file": module.__file__}
        except Exception as exc:  # any failure to import is what this step reports
            info["packages"][name] = {"version": None, "why": f"{type(exc).__name__}: {exc}"}
    import vllm_from_scratch
    from bench import NANO_VLLM_DIRS

    info["vllm_from_scratch"] = vllm_from_scratch.__file__
    info["nano_vllm_source"] = next((str(d) for d in NANO_VLLM_DIRS if (d / "nanovllm").is_dir()), None)
    info["cuda"] = torch.version.cuda
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout or smi.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"not run: {exc}"
    write_json(out / "versions.json", info)
    print(info["nvidia_smi"])
    for name, pkg in info["packages"].items():
        print(f"{name:<14} {pkg.get('version') or 'missing: ' + pkg['why']}")
    pkgs = info["packages"]
    print(
        f"result: python {info['python']}, torch {pkgs['torch']['version']}, triton {pkgs['triton']['version']}, "
        f"transformers {pkgs['transformers']['version']}; {info['device'] or 'no CUDA device'}"
    )


# ---------------------------------------------------------------------------------- checkpoint
def checkpoint(model_dir: Path, tiny: bool) -> None:
    """Build the checkpoint unless a complete one is there (a later call on a warm machine reuses it)."""
    from bench import make_qwen3_06b_shaped

    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        print(f"reusing {model_dir}")
        return
    start = time.perf_counter()
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    make_qwen3_06b_shaped(str(tmp), **(TINY_QWEN3 if tiny else {}))
    tmp.rename(model_dir)
    print(f"built {model_dir} in {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------------------------- kernels
def _paged_inputs(q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype, device):
    """Random q and a paged K/V cache whose blocks are handed out in a shuffled order."""
    gen = torch.Generator().manual_seed(0)
    widths = [-(-n // bs) for n in kv_lens]
    num_blocks = sum(widths) + 1
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(kv_lens), max(widths), dtype=torch.int32)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = order[used : used + w]
        used += w
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), k.to(dtype), v.to(dtype), cu, lens, tables)]


def _rejection_case(batch: int, k: int, vocab: int, device: str) -> dict:
    """The Triton rejection sampler against chapter 05's torch one on the same noise: equal tokens."""
    from rejection_sampler_triton import rejection_sample_triton
    from spec_decode import rejection_sample, sample_rejection_noise

    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 3, dim=-1)
    draft = 0.5 * torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, dim=-1) + 0.5 * target[:, :k]
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    ids[-1, k - 1 :] = -1  # a request with fewer drafts
    ids, draft, target = ids.to(device), draft.to(device), target.to(device)
    noise = sample_rejection_noise(batch, k, vocab, device, torch.Generator(device=device).manual_seed(1))
    expected = rejection_sample(ids, draft, target, noise=noise)
    got = rejection_sample_triton(ids, draft, target, noise=noise)
    ok = torch.equal(got, expected)
    err = 0.0 if ok else None
    return dict(kernel="rejection_sample", dtype="torch.float32", block_size=None, max_abs_err=err, ok=ok)


def kernels(out: Path, dry_run: bool) -> None:
    """Each Triton kernel against the torch reference (computed in float32 from the same inputs),
    at the engine's shapes; a dry run keeps the shapes and shortens the sequences."""
    from attention_backends import AttentionMetadata, paged_attention
    from store_kvcache import store_kvcache_torch, store_kvcache_triton
    from triton_setup import HAS_TRITON, INTERPRETED

    if not HAS_TRITON or not (torch.cuda.is_available() or INTERPRETED):
        print("skipped: Triton needs a GPU here (or TRITON_INTERPRET=1 on a CPU)")
        raise SystemExit(SKIPPED)
    device = "cpu" if dry_run else "cuda"
    # Qwen3-0.6B's heads and vocabulary, block sizes 16 (the engine's) and 256 (flash-attn's).
    hq, hkv, d, block_sizes, vocab = 16, 8, 128, (16, 256), 151936
    if dry_run:  # the interpreter is slow and numpy has no bfloat16: short sequences, fp16 and fp32
        dtypes = (torch.float16, torch.float32)
        decode_lens, varlen = [1, 16, 17, 300], ([1, 5], [20, 260])
    else:  # lengths on and around block edges
        dtypes = (torch.bfloat16, torch.float16)
        decode_lens, varlen = [1, 15, 16, 17, 255, 256, 257, 1000, 3000], ([1, 7, 64, 300], [400, 7, 64, 1200])
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
    cases, failed = [], 0
    for dtype in dtypes:
        for bs in block_sizes:
            for kind, (q_lens, kv_lens) in (("decode", ([1] * len(decode_lens), decode_lens)), ("varlen", varlen)):
                q, kc, vc, cu, lens, bt = _paged_inputs(q_lens, kv_lens, hq, hkv, d, bs, dtype, device)
                md = AttentionMetadata(torch.full((q.shape[0],), -1, device=q.device), cu, lens, bt, max(q_lens))
                got = paged_attention(q, kc, vc, md, d**-0.5, backend="triton")
                ref = paged_attention(q.float(), kc.float(), vc.float(), md, d**-0.5, backend="torch")
                err = (got.float() - ref).abs().max().item()
                ok = err <= tolerance[dtype]
                failed += not ok
                cases.append(
                    dict(kernel=f"paged_attention_{kind}", dtype=str(dtype), block_size=bs, max_abs_err=err, ok=ok)
                )
            # store_kvcache: a copy, so bit-exact; the slot order is shuffled, with one -1 (skipped).
            tokens = 37
            key = torch.randn(tokens, hkv, d, device=device).to(dtype)
            value = torch.randn(tokens, hkv, d, device=device).to(dtype)
            slots = torch.randperm(4 * bs * 4, device=device)[:tokens]
            slots[5] = -1
            caches = [torch.zeros(16, bs, hkv, d, dtype=dtype, device=device) for _ in range(4)]
            store_kvcache_triton(key, value, caches[0], caches[1], slots)
            store_kvcache_torch(key, value, caches[2], caches[3], slots)
            ok = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
            failed += not ok
            cases.append(
                dict(kernel="store_kvcache", dtype=str(dtype), block_size=bs, max_abs_err=0.0 if ok else None, ok=ok)
            )
    cases.append(_rejection_case(2, 2, vocab, device) if dry_run else _rejection_case(64, 4, vocab, device))
    failed += not cases[-1]["ok"]
    for c in cases:
        verdict = "ok" if c["ok"] else "FAILED"
        block = c["block_size"] or "-"
        print(f"{c['kernel']:<26} {c['dtype']:<16} block {block:>4}  max|err| {c['max_abs_err']}  {verdict}")
    write_json(out / "kernels.json", {"device": device, "heads": [hq, hkv, d], "cases": cases})
    if failed:
        raise SystemExit(f"result: {failed} of {len(cases)} kernel cases outside tolerance")
    print(
        f"result: {len(cases)} kernel cases within tolerance, dtypes {[str(t) for t in dtypes]}, blocks {block_sizes}"
    )


# ---------------------------------------------------------------------------------- parity
def parity(model_dir: Path, out: Path, dry_run: bool, quick: bool = False) -> None:
    """Greedy tokens of the engine (CUDA graphs on) against transformers' ``generate``, float32:
    bit-level agreement is not expected, so a token may flip only where the top two logits tie.
    bfloat16 is reported too (where the first divergence falls), not judged; ``quick`` skips it."""
    from transformers import AutoModelForCausalLM

    from vllm_from_scratch import LLM, SamplingParams

    device = "cpu" if dry_run else "cuda"
    vocab = TINY_QWEN3["vocab_size"] if dry_run else 10000
    gen = torch.Generator().manual_seed(1)
    lengths = (5, 9) if dry_run else (16, 40, 100, 333)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    new_tokens = 4 if dry_run else 32
    report: dict = {"device": device, "new_tokens": new_tokens, "prompt_lens": list(lengths), "runs": {}}
    for dtype in ("float32",) if dry_run or quick else ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        expected = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p], device=device)
                full = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                expected.append(full[0, len(p) :].tolist())
        del hf
        # A dry run checks the plumbing on a CPU: eager, so it compiles no graphs a GPU would not use.
        llm = LLM(
            str(model_dir),
            device=device,
            dtype=dtype,
            max_model_len=1024,
            num_kvcache_blocks=512,
            max_num_seqs=8,  # four prompts: a few graphs to capture, not 20
            warm_up=False,
            enforce_eager=dry_run,
        )
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
        first_diff = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
        report["runs"][dtype] = {"match": got == expected, "first_divergence": first_diff}
        print(f"{dtype}: {'identical' if got == expected else 'differs'}; first divergence per prompt {first_diff}")
        if device == "cuda":
            torch.cuda.empty_cache()
    write_json(out / "parity.json", report)
    if not report["runs"]["float32"]["match"]:
        raise SystemExit("result: float32 greedy tokens differ from transformers")
    print(f"result: float32 greedy tokens identical to transformers on {len(prompts)} prompts")


# ---------------------------------------------------------------------------------- decode
def _decode_batch(runner, batch_size: int, context: int):
    from block_manager import cdiv
    from chunked_prefill import SchedulerInfo, build_batch_inputs

    width = cdiv(context + 1, runner.block_size)
    info = SchedulerInfo()
    for i in range(batch_size):
        info.add_row(f"r{i}", [1], context, list(range(i * width, (i + 1) * width)), samples=True, is_decoding=True)
    return build_batch_inputs(info, runner.block_size, runner.device)


def _time_ms(fn, iters: int, cuda: bool) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on a GPU, so launch queues are drained)."""
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def decode(model_dir: Path, out: Path, dry_run: bool) -> None:
    """Decode step time (model forward + logits, with and without CUDA graphs) at batch 1 and
    64 against ``(weights + KV read) / HBM bandwidth``; one eager step profiled; memory."""
    from torch.profiler import ProfilerActivity, profile

    from vllm_from_scratch.config import EngineConfig
    from vllm_from_scratch.model_runner import ModelRunner

    cuda = not dry_run
    batch_sizes, context, iters = ((1, 2), 8, 3) if dry_run else ((1, 64), 512, 50)
    config = EngineConfig(
        str(model_dir),
        device="cuda" if cuda else "cpu",
        dtype="bfloat16",
        max_num_seqs=max(batch_sizes),
        max_model_len=4096 if cuda else 256,
        warm_up=False,
        enforce_eager=dry_run,
    )
    runner = ModelRunner(config)
    name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    bandwidth = hbm_bandwidth(name) if cuda else None
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = runner.kv_cache
    kv_per_token = kv[:, :, 0, 0].numel() * kv.element_size()  # K and V, every layer, one token
    graphs = runner.graph_runner
    rows = []
    for b in batch_sizes:
        batch = _decode_batch(runner, b, context)
        row: dict = {"batch": b, "context": context}
        runner.graph_runner = None
        row["eager_ms"] = _time_ms(functools.partial(runner.compute_logits, batch), iters, cuda)
        runner.graph_runner = graphs
        row["graphs_ms"] = _time_ms(functools.partial(runner.compute_logits, batch), iters, cuda) if graphs else None
        read = weights + b * (context + 1) * kv_per_token
        row["bytes_read"] = read
        row["floor_ms"] = read / bandwidth * 1e3 if bandwidth else None
        best = row["graphs_ms"] or row["eager_ms"]
        row["floor_share"] = row["floor_ms"] / best if row["floor_ms"] else None
        rows.append(row)
        print(
            f"decode B={b:<3} ctx {context}: eager {row['eager_ms']:.3f} ms, graphs "
            f"{row['graphs_ms'] if row['graphs_ms'] is None else round(row['graphs_ms'], 3)} ms, "
            f"floor {row['floor_ms'] if row['floor_ms'] is None else round(row['floor_ms'], 3)} ms"
        )
    # One eager decode step at the largest batch, under the profiler.
    runner.graph_runner = None
    batch = _decode_batch(runner, max(batch_sizes), context)
    runner.compute_logits(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        runner.compute_logits(batch)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=30)
    (out / "profile_decode.txt").write_text(
        f"one eager decode step, batch {max(batch_sizes)}, context {context}\n{table}\n"
    )
    print(table)
    memory: dict = {"kv_cache_bytes": kv.numel() * kv.element_size(), "profile": runner.memory_profile}
    if cuda:
        # The largest steps again, measured against what sizing assumed for them.
        at_rest = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        runner.warm_up([config.max_num_batched_tokens], [max(batch_sizes)])
        memory["at_rest"] = at_rest
        memory["step_peak_above_rest"] = torch.cuda.max_memory_allocated() - at_rest
        memory["within_profile"] = memory["step_peak_above_rest"] <= runner.memory_profile["activation_peak"]
    else:
        memory["rule"] = (
            f"CPU: a fixed cpu_kvcache_space_gib ({config.cpu_kvcache_space_gib} GiB), capped by max_num_seqs"
        )
    report = {"device": name, "bandwidth": bandwidth, "weight_bytes": weights, "kv_bytes_per_token": kv_per_token}
    write_json(out / "decode.json", {**report, "steps": rows, "memory": memory})
    times = ", ".join(f"B={r['batch']} {r['graphs_ms'] or r['eager_ms']:.3f} ms" for r in rows)
    floors = ", ".join(f"{r['floor_ms']:.3f}" for r in rows if r["floor_ms"]) or "unknown card"
    mem = ""
    if cuda:
        mib, gib, profiled = 2**20, 2**30, runner.memory_profile
        mem = (
            f"; KV {memory['kv_cache_bytes'] / gib:.1f} GiB of a {profiled['kv_budget'] / gib:.1f} GiB budget, "
            f"step peak {memory['step_peak_above_rest'] / mib:.0f} MiB, "
            f"profiled {profiled['activation_peak'] / mib:.0f} MiB"
        )
    print(f"result: decode {times}; floor {floors}{mem}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("versions", help="versions, the card, nvidia-smi").add_argument("out", type=Path)
    p = sub.add_parser("checkpoint", help="build the Qwen3-0.6B-shaped checkpoint once")
    p.add_argument("model_dir", type=Path)
    p.add_argument("--tiny", action="store_true", help="shrunk for a CPU dry run")
    p = sub.add_parser("kernels", help="Triton kernels against the torch reference")
    p.add_argument("out", type=Path)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    for step, text in (
        ("parity", "greedy tokens against transformers"),
        ("decode", "decode step time, profile, memory"),
    ):
        p = sub.add_parser(step, help=text)
        p.add_argument("model_dir", type=Path)
        p.add_argument("out", type=Path)
        p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
        if step == "parity":
            p.add_argument("--quick", action="store_true", help="float32 only (the judged run)")
    args = parser.parse_args(argv)
    if args.step == "versions":
        versions(args.out)
    elif args.step == "checkpoint":
        checkpoint(args.model_dir, args.tiny)
    elif args.step == "kernels":
        kernels(args.out, args.dry_run)
    elif args.step == "parity":
        parity(args.model_dir, args.out, args.dry_run, args.quick)
    else:
        decode(args.model_dir, args.out, args.dry_run)


if __name__ == "__main__":
    main()
