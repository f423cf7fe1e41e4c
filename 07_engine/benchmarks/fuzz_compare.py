"""Which fuzzer finds more of what is wrong with a server: the book's Hypothesis strategies, or
Schemathesis over the server's own OpenAPI schema? Each gets the same time against the same
server, through one recording proxy that judges every answer the same way.

    python 07_engine/benchmarks/fuzz_compare.py --tree /tmp/old --seconds 120 --schemathesis /tmp/st/bin/st

It starts ``python -m vllm_from_scratch.serve`` from ``--tree`` (a checkout, e.g. a
``git worktree`` of an older commit; default: this one) on the default model cut to one layer,
with the fuzz test's engine settings, behind a proxy on another port. Every answer that passes through
is judged by ``request_fuzzing.fault`` (a 5xx, a 4xx that is not OpenAI's JSON or names no field
the body sent, a 200 that does not hold together), and a server that dies is counted and
restarted. The table gives, per fuzzer, the requests sent and the distinct kinds of fault found.
Schemathesis is not a dependency of the book: install it in a virtualenv of its own
(``python -m venv /tmp/st && /tmp/st/bin/pip install schemathesis``) and pass its ``st``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench_server_stall import tree_env
from machine import machine_line
from request_fuzzing import encode, fault, requests
from server_testing import ServerProcess, free_port
from test_server_fuzz import ENGINE_ARGS, one_layer_model

KEY = "fuzz-key"
REPO = Path(__file__).resolve().parents[2]


class Judge:
    """The server under test, restarted when it dies, and the faults of every answer."""

    def __init__(self, tree: Path, model_dir: str):
        self.args = ["vllm_from_scratch.serve", model_dir, "--api-key", KEY, *ENGINE_ARGS]
        self.env = tree_env(tree)
        self.server = ServerProcess(self.args, env=self.env).start()
        self.faults: Counter[str] = Counter()
        self.sent = 0
        self.lock = threading.Lock()

    def forward(self, method: str, path: str, headers: dict, content: bytes) -> httpx.Response:
        with self.lock:
            self.sent += 1
            try:
                response = httpx.request(method, self.server.url + path, headers=headers, content=content, timeout=300)
            except httpx.HTTPError:
                response = httpx.Response(599, text="no answer")
            if self.server.proc is not None and self.server.proc.poll() is not None:
                self.faults[f"the server process died ({path})"] += 1
                self.server.stop()
                self.server = ServerProcess(self.args, env=self.env).start()
            return response

    def judge(self, path: str, body: object, response: httpx.Response) -> None:
        problem = fault(path, body, response)
        if problem is not None:
            with self.lock:
                self.faults[problem] += 1

    def stop(self) -> None:
        self.server.stop()


def proxy_app(judge: Judge) -> Starlette:
    """Forwards everything to the server; judges the POSTs to the four fuzzed paths."""

    async def handle(request: Request) -> Response:
        content = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        path = request.url.path
        response = await _in_thread(judge.forward, request.method, path, headers, content)
        if request.method == "POST" and path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            try:
                json_body = "json" in request.headers.get("content-type", "")
                body = json.loads(content) if json_body else None
            except ValueError:
                body = None  # not JSON: no field to name
            judge.judge(path, body, response)
        keep = {k: v for k, v in response.headers.items() if k.lower() in ("content-type",)}
        return Response(response.content, status_code=response.status_code, headers=keep)

    return Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])])


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def serve_proxy(judge: Judge) -> tuple[str, uvicorn.Server]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(proxy_app(judge), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


class TimeUp(Exception):
    pass


def run_hypothesis(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)

    @settings(
        max_examples=10**9,
        phases=[Phase.generate],
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(request=requests())
    def send(request):
        if time.monotonic() > deadline:
            raise TimeUp
        path, body = request
        client.post(path, content=encode(body), headers={"Content-Type": "application/json"})

    try:
        send()
    except TimeUp:
        pass


def run_schemathesis(url: str, seconds: float, st: str) -> None:
    command = [st, "run", f"{url}/openapi.json", "--url", url, "-H", f"Authorization: Bearer {KEY}"]
    command += ["--max-time", str(int(seconds)), "--workers", "1", "--checks", "not_a_server_error"]
    with tempfile.TemporaryDirectory() as scratch:  # where it keeps its own files
        subprocess.run(
            command, cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=seconds + 600
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout whose server is fuzzed (default: this one)")
    parser.add_argument("--seconds", type=float, default=120.0, help="time each fuzzer gets (default: %(default)s)")
    parser.add_argument(
        "--schemathesis", metavar="ST", help="Schemathesis' `st` command; without it only Hypothesis runs"
    )
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = one_layer_model(Path(tmp) / "one-layer")
        tools = {"hypothesis (request_fuzzing)": lambda url: run_hypothesis(url, args.seconds)}
        if args.schemathesis:
            tools["schemathesis (OpenAPI schema)"] = lambda url: run_schemathesis(url, args.seconds, args.schemathesis)
        results = {}
        for name, run in tools.items():
            judge = Judge(args.tree, model_dir)
            url, proxy = serve_proxy(judge)
            try:
                run(url)
            finally:
                proxy.should_exit = True
                judge.stop()
            results[name] = (judge.sent, judge.faults)
    print(f"\nserver from {args.tree}; {args.seconds:.0f} s per fuzzer\n")
    print("| fuzzer | requests | distinct faults | requests with a fault |\n| --- | ---: | ---: | ---: |")
    for name, (sent, faults) in results.items():
        print(f"| {name} | {sent} | {len(faults)} | {sum(faults.values())} |")
    for name, (_, faults) in results.items():
        print(f"\n{name}:")
        for kind, count in faults.most_common():
            print(f"  {count:5d}  {kind}")


if __name__ == "__main__":
    main()
