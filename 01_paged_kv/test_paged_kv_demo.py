"""The chapter's demo runs, prints its table, and its numbers add up."""

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).with_name("demo.py")


def test_demo_runs_and_paging_wastes_less(tmp_path):
    png = tmp_path / "waste.png"
    out = subprocess.run(
        [sys.executable, str(DEMO), "--num-requests", "200", "--block-sizes", "16", "256", "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    # Columns after the scheme: reserved slots, waste %, KV GiB, requests that fit.
    waste = {
        line[:24].strip(): float(line[24:].split()[1])
        for line in out.splitlines()
        if line.startswith(("contiguous", "paged, block", "tokens actually used"))
    }
    assert set(waste) == {"tokens actually used", "contiguous (4096)", "paged, block 16", "paged, block 256"}
    assert waste["tokens actually used"] == 0.0
    assert waste["paged, block 16"] < 5.0 < waste["contiguous (4096)"]
    assert waste["paged, block 16"] < waste["paged, block 256"] < waste["contiguous (4096)"]
    assert "paged waste is at most (block_size - 1) slots per request" in out
    assert png.stat().st_size > 0


def test_demo_help():
    out = subprocess.run(
        [sys.executable, str(DEMO), "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "--plot" in out
