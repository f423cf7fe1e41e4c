"""The chapter's demo runs (so it cannot rot) and what it prints is what it claims."""

import os
import re
import subprocess
import sys
from pathlib import Path

from paged_attention_cpu import cpu_kernel_available

HERE = Path(__file__).parent
# Without TRITON_INTERPRET, as a reader starts it: the demo must switch the interpreter on itself.
READER_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_demo_runs_and_every_path_matches_dense():
    out = subprocess.run(
        [sys.executable, str(HERE / "demo.py"), "--batch-sizes", "1", "4", "--context-len", "64", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        env=READER_ENV,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {
        line.split()[0].rstrip(","): line
        for line in out.stdout.splitlines()
        if line.strip().startswith(("decode", "prefill"))
    }
    for name in ("decode", "prefill"):
        errors = [float(x) for x in re.findall(r"\d\.\d\de[-+]\d\d", rows[name])]
        expected = 3 if cpu_kernel_available() else 2
        assert len(errors) == expected and max(errors) < 1e-4, rows[name]
    assert re.search(r"runs: (torch|cpp|triton|flash)", out.stdout)
    decode_part, varlen_part = out.stdout.split("max |diff|")[1].split("Varlen timing")
    timing = [line.split() for line in decode_part.splitlines()[1:] if line.strip()]
    assert [int(r[0]) for r in timing] == [1, 4] and all(float(r[-1]) < 1e-4 for r in timing)
    varlen = [line.split() for line in varlen_part.splitlines()[2:] if line.strip()]
    assert len(varlen) == 5 and all(float(r[-1]) < 1e-4 for r in varlen), varlen_part


def test_demo_help():
    out = subprocess.run([sys.executable, str(HERE / "demo.py"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout and "--batch-sizes" in out.stdout
