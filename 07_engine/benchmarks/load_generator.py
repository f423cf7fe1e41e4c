"""Load generator: replay a seeded workload against a running server, print vLLM-style results.

    python 07_engine/benchmarks/load_generator.py --num-requests 32 --request-rate 2

Simulated users sending requests to the real HTTP server, measured the way ``vllm bench
serve`` measures it:

* requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once),
  optionally capped at ``--max-concurrency`` in flight;
* every request streams (SSE), so the client sees each token arrive: time to first token
  (TTFT), the gaps between chunks (inter-token latency, ITL) and the end-to-end latency;
* TPOT = (e2e - TTFT) / (output tokens - 1): the mean decode time per token after the first;
* the run is bounded by ``--num-requests`` and ``--max-duration`` seconds (requests still
  running at the deadline are cancelled and counted as failed).

The random workload (default) sends token-id prompts to ``/v1/completions`` with lengths drawn
from ``--input-len`` and ``--output-len`` ranges and ``ignore_eos``, so every request does
exactly the work it asks for. ``--dataset FILE`` replays a fixed prompt set instead (one prompt
per line, or JSON lines with a ``"prompt"`` field). Only loopback servers are accepted: this is
a measuring tool for your own machine, not a load tester for other people's. A server started
with ``--api-key`` needs the same key here (``--api-key``, or ``OPENAI_API_KEY`` as
``vllm bench serve`` reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from tqdm import tqdm


@dataclass
class WorkItem:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def parse_range(text: str) -> tuple[int, int]:
    """``"64"`` or ``"32:128"`` (inclusive) as (low, high)."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname
    if host is None:
        raise ValueError(f"base_url has no host: {base_url!r}")
    if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        raise ValueError(f"base_url must point at a loopback server (127.0.0.1/localhost), got {host!r}")


def random_workload(
    tokenizer_dir: str,
    n: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    as_text: bool = False,
) -> list[WorkItem]:
    """Prompts of random tokens (special tokens excluded) and random lengths.

    Token ids give exact prompt lengths on ``/v1/completions``; the chat endpoint takes text, so
    there the ids are decoded (the length after the chat template is then approximate).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(rng.randint(*input_len))]
        items.append(WorkItem(tokenizer.decode(ids) if as_text else ids, rng.randint(*output_len)))
    return items


def file_workload(path: str, n: int, output_len: tuple[int, int], seed: int) -> list[WorkItem]:
    """A fixed prompt set, cycled to ``n`` requests in file order."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    prompts = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    if not prompts:
        raise ValueError(f"dataset {path!r} holds no prompts")
    rng = random.Random(seed)
    return [WorkItem(prompts[i % len(prompts)], rng.randint(*output_len)) for i in range(n)]


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Gaps between request starts: exponential (a Poisson process) or 0 for ``inf``."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(n)]


def build_payload(item: WorkItem, endpoint: str, model: str, args) -> dict:
    payload = {
        "model": model,
        "max_tokens": item.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        payload["prompt"] = item.prompt
    return payload


async def send_request(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    """Stream one request, timing every chunk that carries text."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("text") or choice.get("delta", {}).get("content"):
                        now = time.perf_counter()
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.ttft > 0.0
        if not result.ok:
            result.error = "no token received"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(args, items: list[WorkItem], model: str) -> tuple[list[RequestResult], float]:
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.max_duration + 60)
    gate = asyncio.Semaphore(args.max_concurrency or len(items) or 1)
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, trust_env=False, headers=auth_headers(args.api_key)
    ) as client:
        if args.warmup:
            warm = await send_request(
                client, url, build_payload(WorkItem(items[0].prompt, 2), args.endpoint, model, args)
            )
            if not warm.ok:
                raise SystemExit(f"warm-up request failed: {warm.error}")
        bar = tqdm(total=len(items), desc="requests", disable=args.quiet)

        async def one(item: WorkItem) -> RequestResult:
            async with gate:
                res = await send_request(client, url, build_payload(item, args.endpoint, model, args))
            bar.update(1)
            return res

        start = time.perf_counter()
        deadline = start + args.max_duration
        tasks = []
        for item, delay in zip(items, arrival_delays(len(items), args.request_rate, args.seed)):
            await asyncio.sleep(delay)
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(one(item)))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        duration = time.perf_counter() - start
        bar.close()
    results = [t.result() for t in tasks if t in done]
    results += [RequestResult(error="cancelled at --max-duration") for _ in pending]
    results += [RequestResult(error="not sent before --max-duration") for _ in range(len(items) - len(tasks))]
    return results, duration


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        summary[f"mean_{name}_ms"] = 1000 * statistics.fmean(values) if values else float("nan")
        summary[f"median_{name}_ms"] = 1000 * statistics.median(values) if values else float("nan")
        summary[f"p99_{name}_ms"] = 1000 * percentile(values, 99) if values else float("nan")
    errors = sorted({r.error for r in results if not r.ok})
    summary["errors"] = errors[:5]
    return summary


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def format_report(s: dict) -> str:
    rows = [
        ("=", " Serving Benchmark Result "),
        ("Successful requests:", s["successful_requests"]),
        ("Failed requests:", s["failed_requests"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
    }
    for key, title in titles.items():
        rows.append(("-", f"{title}"))
        for stat in ("mean", "median", "p99"):
            label = {"mean": "Mean", "median": "Median", "p99": "P99"}[stat]
            rows.append((f"{label} {key.upper()} (ms):", f"{s[f'{stat}_{key}_ms']:.2f}"))
    lines = []
    for left, right in rows:
        if left in ("=", "-"):
            lines.append(f"{right:{left}^50}")
        else:
            lines.append(f"{left:<40}{right:<10}")
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(base_url: str, api_key: str | None = None) -> str:
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30, trust_env=False, headers=auth_headers(api_key))
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model name to request (default: the server's)")
    p.add_argument(
        "--api-key", default=None, help="bearer token for a server started with --api-key (default: $OPENAI_API_KEY)"
    )
    p.add_argument("--dataset", default="random", help="'random' or a prompt file (lines or JSON lines)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer directory for random prompts (default: the embedded default model)"
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals; 'inf' sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--input-len", type=parse_range, default=(32, 128), help="N or LOW:HIGH tokens")
    p.add_argument("--output-len", type=parse_range, default=(16, 64), help="N or LOW:HIGH tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly max_tokens (default on)",
    )
    p.add_argument(
        "--max-duration",
        type=float,
        default=600.0,
        help="stop sending and cancel what still runs after this many seconds",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send one short request first, outside the measurement",
    )
    p.add_argument("--result-json", default=None, help="also write the summary here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (or inf)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_loopback(args.base_url)
    model = args.model or served_model(args.base_url, args.api_key)
    if args.dataset == "random":
        from vllm_from_scratch.default_model import default_model_dir

        items = random_workload(
            args.tokenizer or default_model_dir(),
            args.num_requests,
            args.input_len,
            args.output_len,
            args.seed,
            as_text=args.endpoint == "chat",
        )
    else:
        items = file_workload(args.dataset, args.num_requests, args.output_len, args.seed)
    results, duration = asyncio.run(run_benchmark(args, items, model))
    summary = summarize(results, duration)
    print(format_report(summary))
    if args.result_json:
        settings = {k: v for k, v in vars(args).items() if k != "api_key"}  # no secret in the file
        Path(args.result_json).write_text(
            json.dumps({"args": settings, "summary": summary, "results": [asdict(r) for r in results]}, indent=1)
        )
    return summary


if __name__ == "__main__":
    main()
