"""The chapter's demo runs, prints its table, and its numbers add up."""

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).with_name("demo.py")


def test_demo_runs_and_paging_wastes_less(tmp_path):
    png = tmp_path / "waste.png"
    out = subprocess.run([sys.executable, str(DEMO), "--num-requests", "200", "--plot", str(png)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines()
            if line.startswith(("contiguous", "paged, block 16"))}
    contiguous_waste = float(rows["contiguous (4096)"][1])
    paged_waste = float(rows["paged, block 16"][1])
    assert paged_waste < 5.0 < contiguous_waste
    assert png.stat().st_size > 0


def test_demo_help():
    out = subprocess.run([sys.executable, str(DEMO), "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "--plot" in out
