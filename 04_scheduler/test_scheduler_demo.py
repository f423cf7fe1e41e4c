"""The chapter's scripts run and print what the README says they print."""

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run(script, *args):
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("args", [[], ["--policy", "priority"], ["--prefill-first"]])
def test_demo_runs_and_every_request_is_right(args):
    out = run("demo.py", *args)
    assert out.count(" OK") == 4 and "WRONG" not in out
    assert "1 preemptions, all blocks free: True" in out


def test_compare_policies_prints_a_table():
    out = run("compare_policies.py", "--num-requests", "30", "--max-prompt", "128", "--max-out", "32")
    rows = [line for line in out.splitlines() if line.startswith("| two-phase") or line.startswith("| prefill-first")]
    assert len(rows) == 2


def test_scripts_have_help():
    for script in ("demo.py", "compare_policies.py"):
        assert "usage:" in run(script, "--help")
