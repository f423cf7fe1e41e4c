"""The chapter's demo and benchmark run, and print what the README says."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def run(script, *args):
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_demo_runs_and_chunked_equals_whole():
    out = run("demo.py")
    assert "P long kv_len=36 chunk_len=4 last_pos=3" in out  # the last chunk samples
    assert "P long kv_len=0 chunk_len=6 last_pos=-1" in out  # the first does not
    assert out.count("True") == 3 and "False" not in out


def test_benchmark_prints_the_table_and_saves_a_plot(tmp_path):
    png = tmp_path / "latency.png"
    out = run(
        "bench_chunked_prefill.py",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--long-prompt",
        "96",
        "--chunk",
        "32",
        "--max-tokens",
        "6",
        "--arrive-step",
        "2",
        "--repeats",
        "1",
        "--plot",
        str(png),
    )
    assert "| no chunking |" in out and "| chunked (32) |" in out
    assert png.stat().st_size > 0


def test_scripts_have_help():
    for script in ("demo.py", "bench_chunked_prefill.py"):
        assert "usage:" in run(script, "--help")
