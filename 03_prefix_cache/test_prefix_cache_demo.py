"""The chapter's demo and scripts run (so they cannot rot)."""

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_demo_runs_and_reports_exact_kv():
    out = subprocess.run(
        [sys.executable, str(HERE / "demo.py"), "--requests", "8", "--system-len", "64"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "local hit" in out.stdout and "NO" not in out.stdout.split("K/V exact", 1)[1]
    assert "every block back in the free queue: True" in out.stdout


@pytest.mark.parametrize("script", ["demo.py", "bench_kv_pool.py", "kv_pool_peer.py"])
def test_scripts_have_help(script):
    out = subprocess.run([sys.executable, str(HERE / script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout
