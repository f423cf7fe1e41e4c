"""What each chapter buys inside the engine, on the real model: four A/B runs, one table each.

Each run drives the same ``LLMEngine`` step loop a server drives, with requests arriving at
fixed engine steps (so both sides of an A/B see the same arrivals), and times every token:

* **prefix** (chapter 03): requests sharing a long system prompt, prefix caching off vs on.
  A first request computes the system prompt; then the others arrive together. Time to first
  token (TTFT) of those, the wall time until all have it (their prefill), prompt tokens computed.
* **chunked** (chapter 06): requests decoding while long prompts arrive, chunked prefill off
  (a whole prompt per step) vs on (``--chunk`` tokens per step). The decoding requests'
  inter-token latency (ITL) p50 / p99 / max, and the long prompts' TTFT.
* **spec** (chapter 05): n-gram speculative decoding off vs on, on prompts the model has to
  copy, greedy: output tokens/s, acceptance, tokens per forward, and the outputs compared.
* **priority** (chapter 04): a queue of low-priority requests, then a few high-priority ones,
  ``scheduling_policy`` fcfs vs priority: the high-priority requests' TTFT and end-to-end time.

    .venv/bin/python 07_engine/benchmarks/bench_chapters.py              # all four, default model (~2-4 min)
    .venv/bin/python 07_engine/benchmarks/bench_chapters.py --only spec --json out.json

Every figure depends on the machine: the table is printed with the CPU, its flags, the torch
threads and the load average. Each A/B also counts the requests whose greedy tokens agree: in
float32 they all should; in bfloat16 a different batch shape rounds differently, and a near-tie
between two tokens can then go the other way (the same holds for vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from machine import add_quiet_arg, check_quiet, cpu_name, load_average
from vllm_from_scratch import SamplingParams, default_model_dir
from vllm_from_scratch.engine import LLMEngine

BENCHES = ("prefix", "chunked", "spec", "priority")


@dataclass
class Timeline:
    """When each request arrived and got each of its tokens (seconds, ``perf_counter``)."""

    arrival: dict[str, float] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def ttft(self, rid: str) -> float:
        return self.token_times[rid][0] - self.arrival[rid]

    def e2e(self, rid: str) -> float:
        return self.token_times[rid][-1] - self.arrival[rid]

    def itls(self, rids: list[str]) -> list[float]:
        return [b - a for rid in rids for a, b in zip(self.token_times[rid], self.token_times[rid][1:])]


def run(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams, int]]]) -> Timeline:
    """Drive ``engine`` to the end, adding ``arrivals[step]`` (id, prompt, params, priority) before
    that step; a token's time is when the step that produced it returned."""
    timeline = Timeline()
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params, priority in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id=rid, priority=priority)
            timeline.arrival[rid] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:  # the default output kind: each record holds everything so far
            (completion,) = out.outputs
            if len(completion.token_ids) > len(timeline.outputs.get(out.request_id, [])):
                timeline.token_times.setdefault(out.request_id, []).append(now)
            timeline.outputs[out.request_id] = completion.token_ids
        step += 1
    return timeline


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How many requests produced the same tokens in both runs ("k/n")."""
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def make_engine(args, **overrides) -> LLMEngine:
    kwargs = dict(device="cpu", dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
    kwargs.update(overrides)
    engine = LLMEngine(args.model, **kwargs)
    run(engine, {0: [("warm-up", random_ids(engine, 8, 0), SamplingParams(max_tokens=2, ignore_eos=True), 0)]})
    return engine


def random_ids(engine: LLMEngine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, engine.config.vocab_size, (n,), generator=g).tolist()


# ---------------------------------------------------------------------- chapter 03
def bench_prefix(args) -> dict:
    rows = {}
    for caching in (False, True):
        engine = make_engine(args, enable_prefix_caching=caching)
        system = random_ids(engine, args.shared_len, 1)
        params = SamplingParams(temperature=0.0, max_tokens=args.prefix_new_tokens, ignore_eos=True)
        first = [("first", system + random_ids(engine, args.distinct_len, 2), params, 0)]
        others = [
            (f"r{i}", system + random_ids(engine, args.distinct_len, 100 + i), params, 0)
            for i in range(args.prefix_requests)
        ]
        timeline = run(engine, {0: first, 1: others})
        ids = [rid for rid, *_ in others]
        ttfts = [timeline.ttft(rid) for rid in ids]
        prefill = max(timeline.token_times[rid][0] for rid in ids) - timeline.arrival[ids[0]]
        stats = engine.get_stats()
        computed = stats["prompt_tokens_total"] - stats["prefix_cache_hits"]
        rows["on" if caching else "off"] = dict(
            ttft_mean_ms=1e3 * statistics.mean(ttfts),
            ttft_p99_ms=1e3 * percentile(ttfts, 99),
            prefill_s=prefill,
            prompt_tokens_computed=computed,
            outputs=[timeline.outputs[r] for r in ids],
        )
        engine.shutdown()
    same = agreement(rows["on"].pop("outputs"), rows["off"].pop("outputs"))
    print(
        f"\nChapter 03, prefix caching: {args.prefix_requests} requests sharing a {args.shared_len}-token "
        f"system prompt (+{args.distinct_len} own tokens, {args.prefix_new_tokens} new), after one "
        "request that computed it"
    )
    table(
        ["prefix caching", "TTFT mean ms", "TTFT p99 ms", "their prefill s", "prompt tokens computed"],
        [
            [
                k,
                f"{r['ttft_mean_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
                f"{r['prefill_s']:.2f}",
                f"{r['prompt_tokens_computed']:,}",
            ]
            for k, r in rows.items()
        ],
    )
    print(
        f"requests with the same greedy tokens: {same}; TTFT "
        f"{rows['off']['ttft_mean_ms'] / rows['on']['ttft_mean_ms']:.1f}x lower with the cache"
    )
    return dict(rows, same_tokens=same)


# ---------------------------------------------------------------------- chapter 06
def bench_chunked(args) -> dict:
    rows = {}
    for chunked in (False, True):
        overrides = dict(enable_chunked_prefill=chunked, enable_prefix_caching=False)
        overrides["max_num_batched_tokens"] = args.chunk if chunked else args.max_model_len
        engine = make_engine(args, **overrides)
        decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        arrivals = {0: [(f"d{i}", random_ids(engine, 32, 10 + i), decode, 0) for i in range(args.decoders)]}
        long_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for j in range(args.long_prompts):
            step = args.first_long_at + j * args.long_every
            arrivals.setdefault(step, []).append(
                (f"long{j}", random_ids(engine, args.long_len, 50 + j), long_params, 0)
            )
        timeline = run(engine, arrivals)
        decoders = [f"d{i}" for i in range(args.decoders)]
        itl = timeline.itls(decoders)
        long_ttft = [timeline.ttft(f"long{j}") for j in range(args.long_prompts)]
        rows["on" if chunked else "off"] = dict(
            itl_p50_ms=1e3 * percentile(itl, 50),
            itl_p99_ms=1e3 * percentile(itl, 99),
            itl_max_ms=1e3 * max(itl),
            long_ttft_mean_ms=1e3 * statistics.mean(long_ttft),
            outputs=[timeline.outputs[r] for r in decoders],
        )
        engine.shutdown()
    same = agreement(rows["on"].pop("outputs"), rows["off"].pop("outputs"))
    print(
        f"\nChapter 06, chunked prefill: {args.decoders} requests decoding {args.decode_tokens} tokens while "
        f"{args.long_prompts} prompts of {args.long_len} tokens arrive (chunks of {args.chunk} tokens when on)"
    )
    table(
        ["chunked prefill", "decode ITL p50 ms", "ITL p99 ms", "ITL max ms", "long prompts' TTFT ms"],
        [
            [
                k,
                f"{r['itl_p50_ms']:.0f}",
                f"{r['itl_p99_ms']:.0f}",
                f"{r['itl_max_ms']:.0f}",
                f"{r['long_ttft_mean_ms']:.0f}",
            ]
            for k, r in rows.items()
        ],
    )
    print(
        f"decoding requests with the same greedy tokens: {same}; worst decode gap "
        f"{rows['off']['itl_max_ms'] / rows['on']['itl_max_ms']:.1f}x shorter with chunks"
    )
    return dict(rows, same_tokens=same)


# ---------------------------------------------------------------------- chapter 05
def copy_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """Chat prompts asking to copy a code snippet (a variant per request); repeated random ids
    for a checkpoint without a tokenizer."""
    from bench_spec_decode import COPY_TEXT

    if engine.tokenizer is None:
        return [random_ids(engine, 16, 400 + i) * 4 for i in range(n)]
    texts = [f"Copy this code verbatim:\n\n{COPY_TEXT.replace('a', chr(ord('a') + i))}" for i in range(n)]
    return [
        engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for t in texts
    ]


def bench_spec(args) -> dict:
    rows = {}
    for batch in args.spec_batches:
        for spec in (None, {"method": "ngram", "num_speculative_tokens": args.spec_k}):
            engine = make_engine(args, speculative_config=spec)
            prompts = copy_prompts(engine, batch)
            params = SamplingParams(temperature=0.0, max_tokens=args.spec_tokens, ignore_eos=True)
            start = time.perf_counter()
            timeline = run(engine, {0: [(f"r{i}", p, params, 0) for i, p in enumerate(prompts)]})
            elapsed = time.perf_counter() - start
            stats = engine.get_stats()
            drafts, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
            tokens = sum(len(v) for v in timeline.outputs.values())
            rows[f"batch {batch}, {'ngram k=' + str(args.spec_k) if spec else 'off'}"] = dict(
                tok_s=tokens / elapsed,
                acceptance=accepted / drafts if drafts else None,
                outputs=[timeline.outputs[f"r{i}"] for i in range(batch)],
            )
            engine.shutdown()
    for key, r in rows.items():  # compared with the same batch size without speculation
        base = rows[key.split(",")[0] + ", off"]
        r["speed_up"] = r["tok_s"] / base["tok_s"]
        r["same_tokens"] = agreement(r["outputs"], base["outputs"])
    for r in rows.values():
        del r["outputs"]
    print(
        f"\nChapter 05, n-gram speculative decoding on prompts that copy code, greedy, "
        f"{args.spec_tokens} new tokens each"
    )
    table(
        ["run", "output tok/s", "acceptance", "speed-up", "same greedy tokens"],
        [
            [
                k,
                f"{r['tok_s']:.1f}",
                "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
                f"{r['speed_up']:.2f}x",
                r["same_tokens"],
            ]
            for k, r in rows.items()
        ],
    )
    return rows


# ---------------------------------------------------------------------- chapter 04
def bench_priority(args) -> dict:
    rows = {}
    for policy in ("fcfs", "priority"):
        engine = make_engine(
            args, scheduling_policy=policy, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False
        )
        params = SamplingParams(temperature=0.0, max_tokens=args.priority_tokens, ignore_eos=True)
        arrivals = {0: [(f"low{i}", random_ids(engine, 64, 200 + i), params, 1) for i in range(args.low_requests)]}
        arrivals[args.high_at] = [
            (f"high{i}", random_ids(engine, 64, 300 + i), params, 0) for i in range(args.high_requests)
        ]
        timeline = run(engine, arrivals)
        high = [f"high{i}" for i in range(args.high_requests)]
        low = [f"low{i}" for i in range(args.low_requests)]
        rows[policy] = dict(
            high_ttft_mean_s=statistics.mean(timeline.ttft(r) for r in high),
            high_e2e_mean_s=statistics.mean(timeline.e2e(r) for r in high),
            low_e2e_mean_s=statistics.mean(timeline.e2e(r) for r in low),
        )
        engine.shutdown()
    print(
        f"\nChapter 04, priority scheduling: {args.low_requests} low-priority requests (priority 1), then "
        f"{args.high_requests} high-priority ones (priority 0) at step {args.high_at}; max_num_seqs "
        f"{args.max_num_seqs}, {args.priority_tokens} new tokens each"
    )
    table(
        ["scheduling_policy", "high TTFT mean s", "high end-to-end s", "low end-to-end s"],
        [
            [k, f"{r['high_ttft_mean_s']:.2f}", f"{r['high_e2e_mean_s']:.2f}", f"{r['low_e2e_mean_s']:.2f}"]
            for k, r in rows.items()
        ],
    )
    return rows


def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def machine() -> dict:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return {
        "cpu": cpu_name(),
        "flags": [w for w in wanted if f" {w}" in flags],
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_average(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=list(BENCHES))
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the engine's auto choice)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="every engine runs its forward eagerly (no compiled graphs)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    g = parser.add_argument_group("prefix")
    g.add_argument("--shared-len", type=int, default=1000)
    g.add_argument("--distinct-len", type=int, default=32)
    g.add_argument("--prefix-requests", type=int, default=16)
    g.add_argument("--prefix-new-tokens", type=int, default=8)
    g = parser.add_argument_group("chunked")
    g.add_argument("--decoders", type=int, default=4)
    g.add_argument("--decode-tokens", type=int, default=96)
    g.add_argument("--long-prompts", type=int, default=2)
    g.add_argument("--long-len", type=int, default=2000)
    g.add_argument("--first-long-at", type=int, default=10, help="engine step of the first long prompt")
    g.add_argument("--long-every", type=int, default=30, help="engine steps between long prompts")
    g.add_argument("--chunk", type=int, default=256, help="token budget per step with chunking")
    g = parser.add_argument_group("spec")
    g.add_argument("--spec-k", type=int, default=4)
    g.add_argument("--spec-tokens", type=int, default=96)
    g.add_argument("--spec-batches", type=int, nargs="+", default=[1, 8])
    g = parser.add_argument_group("priority")
    g.add_argument("--max-num-seqs", type=int, default=8)
    g.add_argument("--low-requests", type=int, default=24)
    g.add_argument("--high-requests", type=int, default=4)
    g.add_argument("--high-at", type=int, default=8)
    g.add_argument("--priority-tokens", type=int, default=48)
    add_quiet_arg(parser)
    args = parser.parse_args(argv)
    check_quiet(args.refuse_busy)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model = args.model or default_model_dir()
    info = machine()
    print(
        f"{info['cpu']} ({' '.join(info['flags']) or 'no avx'}), {os.cpu_count()} cores, torch threads "
        f"{info['torch_threads']}, load average {info['load_average_before']}; model {args.model}"
    )
    results = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "json"}}
    for name in tqdm(args.only, desc="benchmarks", disable=len(args.only) == 1):
        results[name] = globals()[f"bench_{name}"](args)
    results["machine"]["load_average_after"] = load_average()
    print(f"\nload average after: {results['machine']['load_average_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
