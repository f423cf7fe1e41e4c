"""The chapter's demo runs (so it cannot rot) and its table says what paging saves."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _waste(stdout: str) -> dict[str, float]:
    rows = {}
    for line in stdout.splitlines():
        if line.startswith(("contiguous", "paged, block", "tokens actually used")):
            scheme, numbers = line[:24].strip(), line[24:].split()
            rows[scheme] = float(numbers[1])  # reserved slots, waste %, KV GiB, fit
    return rows


def test_demo_runs_and_paging_wastes_less_than_contiguous():
    out = subprocess.run([sys.executable, str(HERE / "demo.py"), "--num-requests", "200", "--block-sizes", "16", "256"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    waste = _waste(out.stdout)
    assert set(waste) == {"tokens actually used", "contiguous (4096)", "paged, block 16", "paged, block 256"}
    assert waste["tokens actually used"] == 0.0
    assert waste["paged, block 16"] < waste["paged, block 256"] < waste["contiguous (4096)"]
    assert "paged waste is at most (block_size - 1) slots per request" in out.stdout


def test_demo_help():
    out = subprocess.run([sys.executable, str(HERE / "demo.py"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout and "--block-sizes" in out.stdout
