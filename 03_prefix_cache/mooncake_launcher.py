"""Start and stop the Mooncake services a global KV pool needs, on free loopback ports.

* ``mooncake_master``: the control plane. It decides where each value is placed and serves
  the HTTP metadata that lets transfer engines find each other (no etcd needed).
* ``mooncake_client`` (optional): a standalone process that lends memory to the pool. Values
  placed in it outlive the engines that wrote them.

Both are started in their own process group and stopped with it, so nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mooncake_unavailable_reason() -> str | None:
    """``None`` when the Mooncake store can be used here, else why not (for ``pytest.skip``)."""
    try:
        import mooncake.store  # noqa: F401  (links libibverbs even for TCP)
    except ImportError as exc:
        return f"mooncake.store cannot be imported ({exc}); pip install mooncake-transfer-engine-non-cuda"
    if find_mooncake_binary("mooncake_master") is None:
        return "the mooncake_master binary was not found"
    return None


def find_mooncake_binary(name: str) -> str | None:
    """The real binary inside the ``mooncake`` package (the console script only execs it)."""
    try:
        import mooncake

        candidate = Path(mooncake.__file__).parent / name
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} during start-up")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout} s")


class _Service:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR")
        self.proc = subprocess.Popen(
            argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return self.proc

    def stop(self) -> None:
        """Terminate the process group (SIGTERM, then SIGKILL after 5 s) and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        except ProcessLookupError:
            pass

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MooncakeMaster(_Service):
    """``mooncake_master`` with its HTTP metadata server, on free loopback ports.

    Use as a context manager, or ``start()`` / ``stop()``. ``master_addr`` and ``metadata_url``
    are what :class:`global_kv_pool.MooncakeKVPool` needs. ``extra_args`` go to the binary, e.g.
    ``["--default_kv_lease_ttl=100"]``: a key that was read or checked is leased (undeletable,
    unevictable) for this long, 10 s by default.
    """

    def __init__(self, extra_args: Sequence[str] = ()):
        super().__init__()
        self.extra_args = list(extra_args)
        self.rpc_port = self.http_port = self.metrics_port = 0

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        binary = find_mooncake_binary("mooncake_master")
        if binary is None:
            raise RuntimeError(mooncake_unavailable_reason() or "mooncake_master not found")
        self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        proc = self._spawn(
            [
                binary,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_port={self.metrics_port}",
                *self.extra_args,
            ]
        )
        try:
            _wait_for_port(self.rpc_port, proc, "mooncake_master", timeout)
            _wait_for_port(self.http_port, proc, "mooncake_master's metadata server", timeout)
        except BaseException:
            self.stop()
            raise
        return self


class MooncakeClient(_Service):
    """A standalone ``mooncake_client`` lending ``segment_size`` of its memory to the pool.

    With it, engines can set up with ``global_segment_size=0``: their values are placed in the
    client's segment and survive the engines' exit.
    """

    def __init__(self, master: MooncakeMaster, segment_size: str = "256 MB"):
        super().__init__()
        self.master = master
        self.segment_size = segment_size
        self.port = 0

    def start(self, timeout: float = 30.0) -> MooncakeClient:
        binary = find_mooncake_binary("mooncake_client")
        if binary is None:
            raise RuntimeError("the mooncake_client binary was not found")
        self.port = _free_port()
        proc = self._spawn(
            [
                binary,
                "--host=127.0.0.1",
                f"--port={self.port}",
                f"--global_segment_size={self.segment_size}",
                f"--master_server_address={self.master.master_addr}",
                f"--metadata_server={self.master.metadata_url}",
                "--protocol=tcp",
            ]
        )
        try:
            _wait_for_port(self.port, proc, "mooncake_client", timeout)
        except BaseException:
            self.stop()
            raise
        return self
