"""Soak the server: load past its batch size, with preemption, while another client sends every
kind of bad request; afterwards nothing may be left running, and memory must not grow.

    python 07_engine/benchmarks/soak_server.py --duration 240            # the long soak (topics/serving.md)
    python 07_engine/benchmarks/soak_server.py --duration 0 --rounds 3   # what test_server_soak.py runs

The server runs with an API key (passed in ``VLLM_API_KEY``, as an operator should), a KV cache
of 16 blocks of 16 tokens and ``--max-num-seqs 4``. Each round, ``load_generator.py``'s client
streams ``--num-requests`` requests with ``--max-concurrency`` of them in flight (several times
``max_num_seqs``, so requests wait; four requests of 32 + 64 tokens need 24 blocks, so running
requests are preempted as they grow), while a second client cycles through :func:`bad_requests`
(bad JSON, deep nesting, invalid UTF-8, an unknown model, ``n=2``, a huge seed, NaN, an
oversize body, a wrong key, a stream dropped mid-way, ...) checking each answer. After the
round the server must be idle by its own ``/metrics`` (nothing running or waiting, no KV block
held); then its resident memory, open file descriptors and threads are read from ``/proc``.

Every round replays the same seeded workload. The engine's memory grows with every new batch
*shape* (oneDNN keeps a kernel per matmul shape, bounded by the token budget), not with
requests; repeating the work makes the shapes repeat, so what remains is growth per request,
a leak. Memory is judged after ``--warm-up-rounds``: every later round's RSS must stay within
``--rss-tolerance-mib`` of the RSS the warm-up left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import load_generator as lg
from bench_server_stall import cpu_model
from server_testing import ServerProcess

MAX_MODEL_LEN = 512
SERVER_ARGS = [
    "--max-num-seqs",
    "4",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-kvcache-blocks",
    "16",
    "--log-level",
    "warning",
]


@dataclass
class BadRequest:
    """One bad request and the answer it must get (``param``: the error body's, if not None)."""

    name: str
    path: str
    body: bytes
    status: int
    param: str | None = None
    key: str | None = "ok"  # "ok": the right key; None: no Authorization header; else this key


@dataclass
class Round:
    index: int
    ok_requests: int
    failed_requests: int
    bad_sent: int
    mismatches: list[str]
    idle: bool
    preemptions: float
    rss_mib: float
    seconds: float
    fds: int
    threads: int
    load: str
    errors: list[str] = field(default_factory=list)


def bad_requests(limit: int) -> list[BadRequest]:
    """Every kind of bad input, for a server whose request-size limit is ``limit`` bytes."""
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN))
    return [
        BadRequest("bad JSON", "/v1/completions", b'{"prompt": "hi", ', 400),
        BadRequest("deep nesting", "/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
        BadRequest("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe\xfd"}', 400),
        BadRequest("unknown model", "/v1/completions", _json({"prompt": "hi", "model": "gpt-4o"}), 404, "model"),
        BadRequest("n=0", "/v1/completions", _json({"prompt": "hi", "n": 0}), 400, "n"),
        BadRequest(
            "huge seed", "/v1/completions", b'{"prompt": "hi", "seed": 123456789012345678901234567890}', 400, "seed"
        ),
        BadRequest(
            "NaN",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            400,
            "temperature",
        ),
        BadRequest(
            "priority out of range", "/v1/completions", _json({"prompt": "hi", "priority": 2**63}), 400, "priority"
        ),
        BadRequest(
            "max_tokens 1e20", "/v1/completions", _json({"prompt": "hi", "max_tokens": 10**20}), 400, "max_tokens"
        ),
        BadRequest("prompt over the context", "/v1/completions", _json({"prompt": long_prompt}), 400, "prompt"),
        BadRequest("floats for a prompt", "/v1/completions", _json({"prompt": [1.5] * (limit // 8)}), 400, "prompt"),
        BadRequest("oversize body", "/v1/completions", _json({"prompt": "a" * limit}), 413),
        BadRequest("wrong key", "/v1/completions", _json({"prompt": "hi"}), 401, key="not-the-key"),
        BadRequest("no key", "/v1/models", b"", 401, key=None),
    ]


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


async def send_bad(client: httpx.AsyncClient, url: str, api_key: str, bad: BadRequest) -> str | None:
    """Send one bad request; None if it got the answer it must get, else what went wrong."""
    headers = {"content-type": "application/json"}
    if bad.key is not None:
        headers["authorization"] = f"Bearer {api_key if bad.key == 'ok' else bad.key}"
    method = "POST" if bad.body else "GET"
    resp = await client.request(method, url + bad.path, content=bad.body or None, headers=headers)
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{bad.name}: {resp.status_code}, not an OpenAI error body: {resp.text[:120]!r}"
    if resp.status_code != bad.status or set(error) != {"message", "type", "param", "code"}:
        return f"{bad.name}: {resp.status_code} {error}"
    if bad.param is not None and error["param"] != bad.param:
        return f"{bad.name}: param {error['param']!r}, expected {bad.param!r}"
    return None


async def drop_a_stream(client: httpx.AsyncClient, url: str, api_key: str) -> str | None:
    """Start a long stream and hang up after its first chunk (the server must abort it)."""
    body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with client.stream(
        "POST", url + "/v1/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
    ) as resp:
        if resp.status_code != 200:
            return f"dropped stream: {resp.status_code}"
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                return None
    return "dropped stream: no chunk"


async def bad_client(url: str, api_key: str, cases: list[BadRequest], done: asyncio.Event) -> tuple[int, list[str]]:
    """Cycle through ``cases`` (and a dropped stream) until ``done``; (sent, mismatches)."""
    sent, mismatches = 0, []
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        while not done.is_set():
            for bad in cases:
                mismatches.append(await send_bad(client, url, api_key, bad))
            mismatches.append(await drop_a_stream(client, url, api_key))
            sent += len(cases) + 1
    return sent, [m for m in mismatches if m]


async def one_round(
    url: str, api_key: str, args: argparse.Namespace, items: list[lg.WorkItem], cases: list[BadRequest]
):
    """The load generator's run of ``items`` and the bad client, side by side."""
    load_args = lg.parse_args(
        [
            "--base-url",
            url,
            "--api-key",
            api_key,
            "--num-requests",
            str(args.num_requests),
            "--max-concurrency",
            str(args.max_concurrency),
            "--quiet",
            "--no-warmup",
            "--max-duration",
            "600",
        ]
    )
    done = asyncio.Event()
    bad = asyncio.create_task(bad_client(url, api_key, cases, done))
    try:
        results, _ = await lg.run_benchmark(load_args, items, lg.served_model(url, api_key))
    finally:
        done.set()
    return results, await bad


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(vllm:[a-z_]+)\{[^}]*\} (\S+)$", text, re.M)}


def wait_idle(url: str, timeout: float = 60) -> bool:
    """True once ``/metrics`` shows nothing running or waiting and an empty KV cache."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(url)
        if (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (0, 0, 0):
            return True
        time.sleep(0.2)
    return False


def proc_status(pid: int) -> tuple[float, int, int]:
    """(resident MiB, open file descriptors, threads) of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")), threads


def soak(args: argparse.Namespace) -> list[Round]:
    """Rounds until ``--duration`` seconds passed (at least ``--rounds``); one line printed each."""
    from vllm_from_scratch.api_server import default_max_request_bytes

    api_key = secrets.token_urlsafe(24)
    cases = bad_requests(default_max_request_bytes(MAX_MODEL_LEN))
    items = lg.random_workload(args.tokenizer, args.num_requests, args.input_len, args.output_len, args.seed)
    rounds: list[Round] = []
    with ServerProcess(["vllm_from_scratch.serve", *SERVER_ARGS], env={"VLLM_API_KEY": api_key}) as server:
        url, pid = server.url, server.proc.pid
        print(f"server {' '.join(SERVER_ARGS)}, cpu {cpu_model()} x{os.cpu_count()}")
        print("round  seconds  ok  failed  bad sent  mismatches  idle  preemptions  RSS MiB  fds  threads  load avg")
        start = time.time()
        while len(rounds) < args.rounds or time.time() - start < args.duration:
            round_start = time.time()
            results, (sent, mismatches) = asyncio.run(one_round(url, api_key, args, items, cases))
            idle = wait_idle(url)
            rss, fds, threads = proc_status(pid)
            r = Round(
                len(rounds) + 1,
                sum(x.ok for x in results),
                sum(not x.ok for x in results),
                sent,
                mismatches,
                idle,
                metrics(url)["vllm:num_preemptions_total"],
                rss,
                time.time() - round_start,
                fds,
                threads,
                " ".join(f"{x:.2f}" for x in os.getloadavg()),
                sorted({x.error for x in results if not x.ok}),
            )
            print(
                f"{r.index:>5} {r.seconds:>8.1f} {r.ok_requests:>3} {r.failed_requests:>7} {r.bad_sent:>9}"
                f" {len(r.mismatches):>11}  {'yes' if r.idle else 'NO':>4} {r.preemptions:>12.0f}"
                f" {r.rss_mib:>8.1f} {r.fds:>4} {r.threads:>8}  {r.load}",
                flush=True,
            )
            rounds.append(r)
    return rounds


def verdict(rounds: list[Round], warm_up_rounds: int, rss_tolerance_mib: float) -> list[str]:
    """What went wrong over the soak (empty: it passed)."""
    problems = []
    for r in rounds:
        problems += [f"round {r.index}: {m}" for m in r.mismatches]
        problems += [f"round {r.index}: load request failed: {e}" for e in r.errors]
        if not r.idle:
            problems.append(f"round {r.index}: the server was not idle afterwards")
    if rounds[-1].preemptions == 0:
        problems.append("no request was preempted: the KV cache was not small enough to test that")
    reference, judged = rounds[warm_up_rounds - 1], rounds[warm_up_rounds:]
    growth = max(r.rss_mib for r in judged) - reference.rss_mib
    if growth > rss_tolerance_mib:
        problems.append(
            f"resident memory grew {growth:.1f} MiB after round {reference.index} "
            f"(tolerance {rss_tolerance_mib} MiB): {[round(r.rss_mib) for r in rounds]}"
        )
    for name in ("fds", "threads"):
        if max(getattr(r, name) for r in judged) > getattr(reference, name) + 2:
            problems.append(f"{name} grew: {[getattr(r, name) for r in rounds]}")
    return problems


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=240, help="seconds of soak, at least (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, at least (default: %(default)s)")
    p.add_argument(
        "--warm-up-rounds", type=int, default=1, help="rounds before memory is judged (default: %(default)s)"
    )
    p.add_argument("--num-requests", type=int, default=12, help="load requests per round (default: %(default)s)")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=12,
        help="load requests in flight; the server runs 4 at a time (default: %(default)s)",
    )
    p.add_argument(
        "--input-len", type=lg.parse_range, default=(32, 32), help="prompt tokens, N or LOW:HIGH (default: 32)"
    )
    p.add_argument(
        "--output-len", type=lg.parse_range, default=(64, 64), help="new tokens, N or LOW:HIGH (default: 64)"
    )
    p.add_argument(
        "--rss-tolerance-mib",
        type=float,
        default=32.0,
        help="allowed RSS growth after the warm-up (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="the workload's seed, the same every round")
    p.add_argument("--tokenizer", default=None, help="for the random prompts (default: the default model's)")
    args = p.parse_args(argv)
    if not 1 <= args.warm_up_rounds < args.rounds:
        p.error("--warm-up-rounds must be >= 1 and less than --rounds: memory is judged on the rounds after it")
    if args.tokenizer is None:
        from vllm_from_scratch.default_model import default_model_dir

        args.tokenizer = str(default_model_dir())
    return args


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    rounds = soak(args)
    problems = verdict(rounds, args.warm_up_rounds, args.rss_tolerance_mib)
    print(
        "\n".join(problems)
        if problems
        else f"passed: {len(rounds)} rounds, {sum(r.ok_requests for r in rounds)} requests served, "
        f"{sum(r.bad_sent for r in rounds)} bad requests answered as they must be"
    )
    return problems


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
