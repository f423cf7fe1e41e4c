"""The load generator: its statistics by hand, then a short real run against a live HTTP server
(uvicorn in a thread, serving the scripted engine of ``test_server_protocol.py``)."""

import math
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from transformers import AutoTokenizer

import load_generator as lg
from test_server_protocol import KEY, ScriptedEngine
from vllm_from_scratch.api_server import build_app
from vllm_from_scratch.default_model import default_model_dir


def test_summary_follows_vllm_bench_definitions():
    results = [
        lg.RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        lg.RequestResult(ok=True, prompt_tokens=20, output_tokens=3, ttft=0.3, e2e=0.7, itl=[0.2, 0.2]),
        lg.RequestResult(error="HTTP 400"),
    ]
    s = lg.summarize(results, duration=2.0)
    assert s["successful_requests"] == 2 and s["failed_requests"] == 1
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (e2e - ttft) / (output_tokens - 1): 0.4/4 = 100 ms and 0.4/2 = 200 ms.
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["p99_itl_ms"] == pytest.approx(200.0)
    assert s["errors"] == ["HTTP 400"]
    report = lg.format_report(s)
    assert "Successful requests:" in report and "P99 ITL (ms):" in report


def test_percentile_matches_linear_interpolation():
    assert lg.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert lg.percentile([5.0], 99) == 5.0
    assert lg.percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_poisson_arrivals_have_the_requested_rate():
    gaps = lg.arrival_delays(4000, rate=2.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)
    assert lg.arrival_delays(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_random_workload_is_seeded_and_in_range():
    a = lg.random_workload(default_model_dir(), 5, (4, 8), (2, 3), seed=1)
    b = lg.random_workload(default_model_dir(), 5, (4, 8), (2, 3), seed=1)
    assert a == b
    special = set(AutoTokenizer.from_pretrained(default_model_dir()).all_special_ids)
    assert all(4 <= len(w.prompt) <= 8 and 2 <= w.max_tokens <= 3 for w in a)
    assert not any(t in special for w in a for t in w.prompt)


def test_refuses_non_loopback_servers():
    with pytest.raises(ValueError, match="loopback"):
        lg.check_loopback("http://8.8.8.8:8000")
    lg.check_loopback("http://localhost:8000")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def scripted_server():
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(default_model_dir()))
    engine.step_delay = 0.002
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, "scripted", api_key=KEY), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize("rate", ["inf", "50"])
def test_run_against_a_live_server(scripted_server, rate, capsys):
    url, engine = scripted_server
    summary = lg.main(
        [
            "--base-url",
            url,
            "--api-key",
            KEY,
            "--num-requests",
            "12",
            "--request-rate",
            rate,
            "--input-len",
            "4:8",
            "--output-len",
            "3:6",
            "--quiet",
            "--seed",
            "3",
        ]
    )
    items = lg.random_workload(default_model_dir(), 12, (4, 8), (3, 6), seed=3)
    assert summary["successful_requests"] == 12 and summary["failed_requests"] == 0
    assert summary["total_input_tokens"] == sum(len(w.prompt) for w in items)
    assert summary["total_output_tokens"] == sum(w.max_tokens for w in items)
    assert summary["mean_ttft_ms"] > 0 and not math.isnan(summary["mean_tpot_ms"])
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert not engine.requests


def test_max_duration_bounds_the_run(scripted_server):
    url, engine = scripted_server
    engine.step_delay = 0.05
    try:
        start = time.perf_counter()
        summary = lg.main(
            [
                "--base-url",
                url,
                "--api-key",
                KEY,
                "--num-requests",
                "4",
                "--input-len",
                "4",
                "--output-len",
                "60",
                "--max-duration",
                "0.5",
                "--quiet",
                "--no-warmup",
            ]
        )
        assert time.perf_counter() - start < 5
        assert summary["failed_requests"] == 4
        assert summary["errors"] == ["cancelled at --max-duration"]
        for _ in range(100):  # the cancelled streams' requests are aborted server-side
            if not engine.requests:
                break
            time.sleep(0.05)
        assert not engine.requests
    finally:
        engine.step_delay = 0.002


def test_api_key_from_the_flag_or_openai_api_key(scripted_server, monkeypatch, tmp_path):
    url, _ = scripted_server
    argv = [
        "--base-url",
        url,
        "--num-requests",
        "2",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--quiet",
        "--result-json",
        str(tmp_path / "result.json"),
    ]
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what `vllm bench serve` reads
    assert lg.main(argv)["successful_requests"] == 2
    assert KEY not in (tmp_path / "result.json").read_text()
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(httpx.HTTPStatusError, match="401"):
        lg.main(argv)


def test_help_runs():
    out = subprocess.run([sys.executable, str(Path(lg.__file__)), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--request-rate" in out.stdout
