"""The chapter's scripts keep running: the demo answers, and bench.py's --help works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_demo_chats_offline():
    out = subprocess.run([sys.executable, str(HERE / "demo.py"), "--max-tokens", "10"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout and "Rome" in out.stdout
    assert "prefix-cache hits" in out.stdout


@pytest.mark.parametrize("script", ["demo.py", "bench.py"])
def test_scripts_have_help(script):
    out = subprocess.run([sys.executable, str(HERE / script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout
