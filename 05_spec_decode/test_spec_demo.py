"""The chapter's scripts keep running: the demo end to end, the benchmark's --help."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _run(*args, timeout=300):
    # Without TRITON_INTERPRET, as a reader starts it: the demo must switch the interpreter on itself.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], cwd=HERE.parent, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize("script", ["demo.py", "bench_spec_decode.py"])
def test_scripts_have_help(script):
    result = _run(str(HERE / script), "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_demo_toy_part():
    result = _run(str(HERE / "demo.py"), "--toy-only", "--rows", "20000", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "identical = True" in result.stdout
    assert "sum(min(p, q))" in result.stdout


@pytest.mark.slow
def test_demo_with_the_default_model():
    result = _run(str(HERE / "demo.py"), "--rows", "20000", "--max-new-tokens", "12", "--draft-tokens", "6")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("same output: True") == 2, result.stdout
    assert "n-gram" in result.stdout and "draft (4 layers)" in result.stdout
