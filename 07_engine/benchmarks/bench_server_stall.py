"""Can one client stall another's stream? Measure the longest gap between streamed tokens while
a second client posts huge or pathological bodies, or the largest requests the limits allow.

    python 07_engine/benchmarks/bench_server_stall.py                          # this checkout, every attack
    python 07_engine/benchmarks/bench_server_stall.py --tree /tmp/before       # another checkout, same venv
    python 07_engine/benchmarks/bench_server_stall.py --attacks text-8mb --num-posts 3

It starts ``python -m vllm_from_scratch.serve`` from ``--tree`` (its chapter directories first on
``PYTHONPATH``, so a ``git worktree`` of an older commit runs its own code with this venv), opens
one streaming completion (greedy, ``ignore_eos``), and once tokens flow fires ``--num-posts``
concurrent posts of one attack from other connections. Each attack reports the stream's
longest inter-token gap before the posts (the baseline) and while they were being answered, and
what the posts got back. The attacks:

* ``text-8mb``: an 8 MB English-like prompt (about 1.4 M tokens, far over ``max_model_len``);
* ``text-limit``: a prompt whose body is just under the request-size limit (default: the
  server's default limit for ``--max-model-len``), so it is read, parsed and tokenized;
* ``floats-limit``: ``"prompt": [1.5, 1.5, ...]`` just under the limit: every item is wrong;
* ``chat-limit``: thousands of short chat messages just under the limit, rendered by the
  chat template;
* ``n-max``: ``n`` at ``max_n_sequences`` (``--max-n``, default 256), 8 tokens each;
* ``context-max``: ``n`` 65 completions of a 3,900-token prompt, 64 tokens each: the most KV
  cache ``max_request_kv_tokens`` (262,144) lets one request hold, read by every decode step;
* ``logprobs-max``: a 3,000-token prompt echoed with 20 logprobs per token, 20 prompt logprobs
  and ``n`` 7: the largest response ``max_response_logprobs`` (1,000,000) lets through, not
  streamed;
* ``logprobs-wide``: the same prompt, ``n`` 64 (refused now; what a server without the limit did);
* ``batch-max``: 1,024 short prompts (``max_completion_prompts``) of 16 tokens each;
* ``bias-max``: ``n`` 256 with a 40,000-entry ``logit_bias`` and ``min_tokens`` 8 over 10,000
  ``stop_token_ids`` (per-step work the engine thread does for every completion);
* ``penalty-max``: all three penalties on a 3,500-token prompt, ``n`` 73 (the most
  ``max_request_kv_tokens`` allows), or ``--max-n`` if that is lower.

The last seven are sent once each (``--num-posts 1`` is their natural setting). Prompt lengths
are the default model's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from machine import add_quiet_arg, check_quiet
from server_testing import ServerProcess

REPO = Path(__file__).resolve().parents[2]
ATTACKS = ("text-8mb", "text-limit", "floats-limit", "chat-limit")
LIMIT_ATTACKS = ("n-max", "context-max", "logprobs-max", "logprobs-wide", "batch-max", "bias-max", "penalty-max")
WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or have an they "
    "which one you were all we her she there would their will when who him been has more if no "
    "out so said what up its about into than them can only other time new some could these two "
    "may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three"
).split()


@dataclass
class Attack:
    name: str
    path: str
    body: bytes


@dataclass
class Outcome:
    name: str
    baseline_gap: float
    attack_gap: float
    attack_seconds: float
    statuses: list[str] = field(default_factory=list)


def english(nbytes: int, seed: int = 0) -> str:
    """Random common words, about 5.7 bytes a token with the default tokenizer."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < nbytes:
        word = rng.choice(WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:nbytes]


def make_attack(kind: str, limit: int, max_n: int = 256) -> Attack:
    """The body of one attack post (``model`` left out, as the API allows); the ``-limit`` kinds
    are sized to ``limit`` minus 64 bytes, the ``-max`` kinds to the server's default limits
    (``n`` up to ``max_n``)."""
    target = limit - 64
    long_prompt = english(14_400, seed=2)  # about 3,000 tokens
    sampled = {"temperature": 1.0, "ignore_eos": True}
    if kind == "n-max":
        return Attack(kind, "/v1/completions", _json({"prompt": english(200), "n": max_n, "max_tokens": 8, **sampled}))
    if kind == "context-max":  # 65 x (3,913 + 64) = 258,505 tokens of KV cache, under 262,144
        body = {"prompt": english(18_600, seed=4), "n": min(max_n, 65), "max_tokens": 64, **sampled}
        return Attack(kind, "/v1/completions", _json(body))
    if kind in ("logprobs-max", "logprobs-wide"):
        n = 7 if kind == "logprobs-max" else 64
        body = {"prompt": long_prompt, "n": n, "max_tokens": 1, "echo": True, "logprobs": 20, "prompt_logprobs": 20}
        return Attack(kind, "/v1/completions", _json({**body, **sampled}))
    if kind == "batch-max":
        prompts = [english(60, seed=i) for i in range(1024)]
        return Attack(kind, "/v1/completions", _json({"prompt": prompts, "max_tokens": 16, **sampled}))
    if kind == "bias-max":
        bias = {str(t): -1.0 for t in range(40_000)}
        stops = list(range(10_000, 20_000))
        body = {"prompt": english(200), "n": max_n, "max_tokens": 8, "logit_bias": bias}
        return Attack(kind, "/v1/completions", _json({**body, "min_tokens": 8, "stop_token_ids": stops, **sampled}))
    if kind == "penalty-max":
        penalties = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
        body = {"prompt": english(17_000, seed=3), "n": min(max_n, 73), "max_tokens": 8, **penalties}  # 3,547 tokens
        return Attack(kind, "/v1/completions", _json({**body, **sampled}))
    if kind == "text-8mb":
        return Attack(kind, "/v1/completions", _json({"prompt": english(8_000_000), "max_tokens": 1}))
    if kind == "text-limit":
        head = len(_json({"prompt": "", "max_tokens": 1}))
        return Attack(kind, "/v1/completions", _json({"prompt": english(target - head), "max_tokens": 1}))
    if kind == "floats-limit":
        return Attack(kind, "/v1/completions", _json({"prompt": [1.5] * (target // 4)}))
    if kind == "chat-limit":
        message = {"role": "user", "content": english(80, seed=1)}
        count = target // (len(_json(message)) + 1)
        return Attack(kind, "/v1/chat/completions", _json({"messages": [message] * count, "max_tokens": 1}))
    raise ValueError(f"unknown attack {kind!r}; choose from {', '.join(ATTACKS + LIMIT_ATTACKS)}")


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def tree_env(tree: Path) -> dict[str, str]:
    """Environment that makes ``python -m vllm_from_scratch.serve`` run ``tree``'s code: its
    chapter directories (the engine's among them) go first on ``PYTHONPATH``, ahead of the venv's
    editable install."""
    dirs = sorted(str(d) for d in tree.iterdir() if d.is_dir() and d.name[:2].isdigit())
    return {"PYTHONPATH": os.pathsep.join(dirs)}


class Streamer(threading.Thread):
    """One long greedy stream; ``times`` holds the arrival of every chunk that carries text."""

    def __init__(self, url: str, model: str):
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.times: list[float] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "model": self.model,
            "prompt": "Once upon a time",
            "max_tokens": 3000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        self.times.append(time.perf_counter())
                    if self.stop.is_set():
                        return  # closing the stream aborts the request server-side
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def wait_for(self, count: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while len(self.times) < count:
            if time.time() > deadline or not self.is_alive():
                raise SystemExit(f"the stream stalled before {count} tokens: {self.error}")
            time.sleep(0.01)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest gap between consecutive chunks whose interval overlaps (start, end)."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    return max(gaps, default=float("nan"))


def post(url: str, attack: Attack) -> str:
    try:
        resp = httpx.post(
            url + attack.path, content=attack.body, timeout=300, headers={"content-type": "application/json"}
        )
        return f"{resp.status_code} ({len(resp.content)} B)"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def run_attack(url: str, model: str, attack: Attack, num_posts: int, baseline_s: float) -> Outcome:
    streamer = Streamer(url, model)
    streamer.start()
    streamer.wait_for(5)
    time.sleep(baseline_s)
    start = time.perf_counter()
    with ThreadPoolExecutor(num_posts) as pool:
        statuses = list(pool.map(lambda _: post(url, attack), range(num_posts)))
    end = time.perf_counter()
    streamer.wait_for(len([t for t in streamer.times if t <= end]) + 3)
    streamer.stop.set()
    streamer.join(30)
    times = streamer.times
    before = [t for t in times if t <= start]  # the baseline: gaps that ended before the posts
    return Outcome(
        attack.name, longest_gap(before, before[0], before[-1]), longest_gap(times, start, end), end - start, statuses
    )


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, default=REPO, help="repository checkout whose server runs (default: this one)")
    p.add_argument(
        "--attacks", default=",".join(ATTACKS), help=f"comma-separated, from {', '.join(ATTACKS + LIMIT_ATTACKS)}"
    )
    p.add_argument("--max-n", type=int, default=256, help="n of the -max attacks (default: %(default)s)")
    p.add_argument("--num-posts", type=int, default=3, help="concurrent posts per attack")
    p.add_argument("--repeat", type=int, default=1, help="run the list of attacks this many times")
    p.add_argument("--max-model-len", type=int, default=4096, help="passed to the server")
    p.add_argument(
        "--limit-bytes",
        type=int,
        default=None,
        help="size of the -limit attacks' bodies, +64 (default: the server's default limit)",
    )
    p.add_argument("--baseline-seconds", type=float, default=2.0, help="streaming before the posts")
    p.add_argument("--server-args", default="", help="more flags for the server, one string")
    add_quiet_arg(p)
    args = p.parse_args(argv)
    check_quiet(args.refuse_busy)
    return args


def main(argv=None) -> list[Outcome]:
    args = parse_args(argv)
    from vllm_from_scratch.api_server import default_max_request_bytes

    limit = args.limit_bytes or default_max_request_bytes(args.max_model_len)
    attacks = [make_attack(kind, limit, args.max_n) for kind in args.attacks.split(",")]
    server_args = ["--max-model-len", str(args.max_model_len), *shlex.split(args.server_args)]
    outcomes = []
    with ServerProcess(
        ["vllm_from_scratch.serve", "--log-level", "warning", *server_args], env=tree_env(args.tree.resolve())
    ) as server:
        url = server.url
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        print(f"tree {args.tree}  cpu {cpu_model()} x{os.cpu_count()}  {args.num_posts} posts per attack")
        print(
            f"{'attack':<14}{'body':>10}{'baseline gap':>14}{'gap under attack':>18}{'posts took':>12}"
            f"  load avg   answers"
        )
        for attack in attacks * args.repeat:
            o = run_attack(url, model, attack, args.num_posts, args.baseline_seconds)
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(
                f"{o.name:<14}{len(attack.body) / 2**20:>8.2f}MB{o.baseline_gap:>13.3f}s{o.attack_gap:>17.3f}s"
                f"{o.attack_seconds:>11.2f}s  {load}  {', '.join(o.statuses)}",
                flush=True,
            )
            outcomes.append(o)
    return outcomes


if __name__ == "__main__":
    main()
