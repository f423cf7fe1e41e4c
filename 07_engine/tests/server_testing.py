"""Start server processes for tests and benchmarks, wait until they answer, stop them cleanly.

Used wherever a test needs a real ``vllm_from_scratch.serve`` (or the disaggregation proxy) in
its own process: nothing is left running, and a server that dies while starting fails with its
log instead of a timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m MODULE *args --port P`` in a subprocess; ``url`` once ``/health`` answers 200.

    Args:
        args: arguments after ``python -m`` (the module first).
        startup_timeout_s: how long to wait for ``/health``.
        env: extra environment variables (e.g. ``OMP_NUM_THREADS``).
    """

    def __init__(self, args: list[str], startup_timeout_s: float = 240.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", *args, "--port", str(self.port)]
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[2]} exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.args[2]} did not become healthy in {self.startup_timeout_s} s")
            time.sleep(0.3)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()
