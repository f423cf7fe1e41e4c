"""The chapter's scripts keep running: the demo answers, bench.py runs end to end and writes
its JSON, and --help works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_from_scratch.loader import resolve_dtype

CHAPTER = Path(__file__).resolve().parents[1]
BENCHMARKS = CHAPTER / "benchmarks"


@pytest.mark.slow
def test_demo_chats_offline():
    out = subprocess.run(
        [sys.executable, str(CHAPTER / "demo.py"), "--max-tokens", "10"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout and "Rome" in out.stdout
    assert "prefix-cache hits" in out.stdout


@pytest.mark.parametrize("script", [CHAPTER / "demo.py", *sorted(BENCHMARKS.glob("*.py"))], ids=lambda path: path.name)
def test_scripts_have_help(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout


@pytest.mark.slow
def test_bench_runs_both_sides_and_writes_json(tiny_llama_dir, tmp_path):
    # A tiny checkpoint and workload: this checks the script's plumbing and defaults, not a speed.
    out_json = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "bench.py"),
        "--model",
        str(tiny_llama_dir),
        "--num-requests",
        "3",
        "--input-len",
        "4",
        "12",
        "--output-len",
        "2",
        "5",
        "--hf-batch-sizes",
        "2",
        "3",
        "--threads",
        "1",
        "--enforce-eager",
        "--json",
        str(out_json),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "output tok/s" in out.stdout and "load average" in out.stdout
    report = json.loads(out_json.read_text())
    assert report["machine"]["torch_threads"] == 1
    assert report["workload"]["num_requests"] == 3
    systems = [row["system"] for row in report["rows"]]
    auto = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")  # the engine's default, decided by the CPU
    assert systems[0] == f"engine {auto} eager"
    assert systems[1:] == [f"transformers {d} (batch {b}, left pad)" for d in ("float32", "bfloat16") for b in (2, 3)]
    assert all(row["output_tokens_per_s"] > 0 for row in report["rows"])
    best = max(row["output_tokens_per_s"] for row in report["rows"][1:])
    engine = report["rows"][0]
    assert abs(engine["vs_transformers"] - engine["output_tokens_per_s"] / best) < 1e-2


@pytest.mark.slow
def test_bench_chapters_runs_the_four_ab_runs(tiny_llama_dir, tmp_path):
    """Plumbing on a tiny checkpoint (no speed claims): every table prints, the A/B runs agree on
    the greedy tokens (float32), and the JSON holds each run's figures."""
    out_json = tmp_path / "chapters.json"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "bench_chapters.py"),
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--shared-len",
        "40",
        "--prefix-requests",
        "3",
        "--decode-tokens",
        "10",
        "--long-len",
        "100",
        "--first-long-at",
        "2",
        "--long-every",
        "3",
        "--chunk",
        "16",
        "--spec-tokens",
        "10",
        "--spec-batches",
        "1",
        "2",
        "--low-requests",
        "6",
        "--high-requests",
        "2",
        "--high-at",
        "2",
        "--priority-tokens",
        "5",
        "--max-num-seqs",
        "2",
        "--enforce-eager",
        "--json",
        str(out_json),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for title in ("Chapter 03", "Chapter 06", "Chapter 05", "Chapter 04", "load average"):
        assert title in out.stdout
    report = json.loads(out_json.read_text())
    assert report["prefix"]["same_tokens"] == "3/3" and report["chunked"]["same_tokens"] == "4/4"
    assert report["prefix"]["on"]["prompt_tokens_computed"] < report["prefix"]["off"]["prompt_tokens_computed"]
    assert all(r["same_tokens"] in ("1/1", "2/2") for r in report["spec"].values())
    assert report["priority"]["priority"]["high_ttft_mean_s"] > 0
