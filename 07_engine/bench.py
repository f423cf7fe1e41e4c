"""Throughput of the engine against transformers' ``generate`` on the same model and workload.

CPU (default): the embedded SmolLM2-135M-Instruct and a fixed seeded serving-shaped workload:
128 requests, prompts of 32-256 random token ids, 16-256 new tokens each, greedy, ignore_eos.
The engine takes them all at once (continuous batching, up to ``--max-num-seqs``);
transformers runs them in static batches, left-padded, one batch after another, at every batch
size of ``--hf-batch-sizes`` (and dtype of ``--hf-dtypes``): the ratio is taken against the
*best* of those runs, so the baseline is tuned, not a strawman. ``--num-requests 32
--output-len 64 128 --hf-batch-sizes 32`` is the small workload of earlier runs (one batch:
nothing for continuous batching to exploit).

``--gpu``: nano-vllm's bench.py workload (256 sequences, input and output lengths uniform in
[100, 1024], temperature 0.6, ignore_eos) on a random checkpoint shaped like Qwen3-0.6B, built
with transformers (no hub), eager and with CUDA graphs.

Throughput counts the tokens that were asked for (sum of max_tokens) over wall time, for both
sides: transformers pads every request of a batch to the longest output, and that waste is its
cost, not extra throughput. Both sides run in this process with the same ``torch`` thread count
(``--threads``); the machine's load average is printed with the table, because other processes
on a shared CPU slow both sides, and not always equally. ``--json PATH`` also writes the table
(and the workload, threads and load) for the docs' figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time

import torch


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    outputs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outputs


def bench_engine(model_dir: str, prompts, outputs, temperature: float, **engine_kwargs) -> float:
    from vllm_from_scratch import LLM, SamplingParams

    llm = LLM(model_dir, **engine_kwargs)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate(outputs)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert [len(o["token_ids"]) for o in outs] == list(outputs)
    llm.shutdown()
    return sum(outputs) / elapsed


def bench_transformers(model_dir: str, prompts, outputs, dtype: str, batch_size: int) -> float:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(batch_prompts, max_new):
        width = max(map(len, batch_prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, pad_token_id=pad)

    run([prompts[0][:16]], 4)  # warm-up
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"transformers {dtype}"):
        run(prompts[i:i + batch_size], max(outputs[i:i + batch_size]))
    return sum(outputs) / (time.perf_counter() - start)


def make_qwen3_06b_shaped(path: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def print_table(rows: list[tuple[str, float]], baseline: float | None) -> None:
    print(f"\n{'system':<42}{'output tok/s':>14}{'vs transformers':>18}")
    print("-" * 74)
    for name, tps in rows:
        ratio = f"{tps / baseline:.2f}x" if baseline else "-"
        print(f"{name:<42}{tps:>14.1f}{ratio:>18}")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def write_json(path: str, workload: dict, rows: list[tuple[str, float]], baseline: float | None,
               load_before: str) -> None:
    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "torch_threads": torch.get_num_threads(), "load_average_before": load_before,
                    "load_average_after": load_average()},
        "workload": workload,
        "rows": [{"system": name, "output_tokens_per_s": round(tps, 2),
                  "vs_transformers": round(tps / baseline, 3) if baseline else None} for name, tps in rows],
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="nano-vllm's workload on a Qwen3-0.6B-shaped model (CUDA)")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", help="engine dtype")
    parser.add_argument("--hf-dtypes", nargs="*", default=["bfloat16"],
                        help="transformers dtypes (float32 is what it loads this checkpoint in by default; "
                             "always slower here)")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 64],
                        help="transformers static batch sizes, each run over the whole workload")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: torch's own choice, the usable cores)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    args = parser.parse_args()
    if min(args.hf_batch_sizes) < 1:
        parser.error("--hf-batch-sizes must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    load_before = load_average()

    if args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu needs CUDA")
        model_dir = args.model or make_qwen3_06b_shaped(tempfile.mkdtemp(prefix="qwen3-0.6b-random-"))
        prompts, outputs = make_workload(256, (100, 1024), (100, 1024), 10000, args.seed)
        rows = []
        for eager in (True, False):
            tps = bench_engine(model_dir, prompts, outputs, 0.6, max_model_len=4096, enforce_eager=eager,
                               dtype="bfloat16")
            rows.append((f"engine bf16 ({'eager' if eager else 'CUDA graphs'})", tps))
        print(f"\n{torch.cuda.get_device_name()}, Qwen3-0.6B-shaped random weights, 256 seqs, in/out 100-1024")
        print_table(rows, None)
        if args.json:
            write_json(args.json, {"model": "Qwen3-0.6B-shaped, random weights", "num_requests": 256,
                                   "input_len": [100, 1024], "output_len": [100, 1024], "temperature": 0.6},
                       rows, None, load_before)
        return

    from vllm_from_scratch import default_model_dir

    model_dir = args.model or default_model_dir()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts, outputs = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab,
                                     args.seed)
    engine_kwargs = dict(dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs)
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    rows = [(f"engine {args.dtype}", bench_engine(model_dir, prompts, outputs, 0.0, **engine_kwargs))]
    hf = [(f"transformers {d} (batch {b}, left pad)", bench_transformers(model_dir, prompts, outputs, d, b))
          for d in args.hf_dtypes for b in args.hf_batch_sizes]
    best_hf = max((t for _, t in hf), default=None)
    print(f"\n{args.num_requests} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, "
          f"{args.output_len[0]}-{args.output_len[1]} new tokens, greedy, ignore_eos; {os.cpu_count()} CPU cores, "
          f"torch threads: {torch.get_num_threads()}; load average (1/5/15 min) before {load_before}, "
          f"after {load_average()}")
    print_table(rows + hf, best_hf)
    if args.json:
        workload = {"model": model_dir, "num_requests": args.num_requests, "input_len": list(args.input_len),
                    "output_len": list(args.output_len), "seed": args.seed, "temperature": 0.0,
                    "engine_dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                    "hf_batch_sizes": args.hf_batch_sizes}
        write_json(args.json, workload, rows + hf, best_hf, load_before)


if __name__ == "__main__":
    main()
