"""floors.py: the machine's floors a benchmark measures beside its table, and the arithmetic that
turns them into the most tok/s a workload can get."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import bench
from floors import (
    SINGLE_STREAM_TARGET,
    THROUGHPUT_TARGET,
    Floors,
    ModelFootprint,
    Target,
    judge,
    linear_kernels,
    measure_gemm_rate,
    measure_read_bandwidth,
    model_footprint,
)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_footprint_counts_every_parameter_once(request, arch):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    footprint = model_footprint(model_dir, torch.bfloat16)
    # A step reads every weight but the embedding matrix, of which it reads one row; a tied head
    # *is* that matrix, read whole as the head (the model's parameters count it once, too).
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    read = params if embedding is model.get_output_embeddings().weight else params - embedding.numel()
    assert footprint.weight_bytes == 2 * read
    assert footprint.head_params == model.get_output_embeddings().weight.numel()
    linears = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert footprint.matmul_params == sum(w.numel() for w in linears)
    assert sum(footprint.matmul_shapes.values()) == len(linears)


def test_a_directory_without_weights_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="model_dir"):
        model_footprint(tmp_path, torch.float32)


FOOTPRINT = ModelFootprint(
    matmul_params=100, head_params=30, other_params=2, matmul_shapes={(10, 10): 1}, bytes_per_param=2
)


@settings(max_examples=50, derandomize=True, deadline=None)
@given(
    read=st.floats(1e3, 1e12),
    gemm=st.floats(1e3, 1e15),
    lengths=st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 1024)), min_size=1, max_size=64),
)
def test_the_floor_is_the_slower_of_reading_the_weights_and_doing_the_matmuls(read, gemm, lengths):
    floors = Floors(read_bytes_per_s=read, gemm_flop_per_s=gemm, footprint=FOOTPRINT)
    prompt, output = sum(p for p, _ in lengths), sum(o for _, o in lengths)
    longest = max(o for _, o in lengths)
    seconds = floors.seconds(prompt, output, len(lengths), longest)
    # By hand: 264 bytes read per decode step; every token fed back through 100 matmul
    # parameters (a request's last token never is), every sampled row through the 30 of the head.
    assert math.isclose(seconds["memory"], longest * 264 / read)
    assert math.isclose(seconds["matmul"], 2 * (100 * (prompt + output - len(lengths)) + 30 * output) / gemm)
    tps = floors.tokens_per_s(prompt, output, len(lengths), longest)
    assert math.isclose(tps, output / max(seconds.values()))


def test_the_rates_are_measured_and_bad_sizes_are_refused():
    assert 0 < measure_read_bandwidth(1 << 20, torch.float32, repeats=2) < math.inf
    assert 0 < measure_gemm_rate({(64, 32): 2}, torch.float32, rows=16, repeats=2) < math.inf
    with pytest.raises(ValueError, match="nbytes"):
        measure_read_bandwidth(0, torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        measure_gemm_rate({}, torch.float32)


@settings(max_examples=12, derandomize=True, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    rows=st.integers(1, 40),
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 70),
)
def test_every_kernel_the_gemm_floor_may_take_computes_the_same_product(dtype, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 10_000 + out_features * 100 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    expected = x.float() @ weight.float().T
    kernels = linear_kernels(weight)
    assert set(kernels) == {"F.linear", "the engine's linear"}
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, kernel in kernels.items():
        torch.testing.assert_close(kernel(x).float(), expected, rtol=tolerance, atol=tolerance, msg=name)


def test_the_gemm_rate_takes_the_fastest_kernel_at_each_shape(monkeypatch):
    # Two fake kernels, one 10 ms and one 50 ms a call: the rate must be the 10 ms one's, whichever
    # comes first, so a slow F.linear cannot lower a floor the engine's own GEMM reaches.
    def kernels(weight):
        slow, fast = (lambda x: time.sleep(0.05)), (lambda x: time.sleep(0.01))
        return {"slow": slow, "fast": fast} if weight.shape[0] == 8 else {"fast": fast, "slow": slow}

    monkeypatch.setattr("floors.linear_kernels", kernels)
    rate = measure_gemm_rate({(8, 4): 1, (16, 4): 1}, torch.float32, rows=2, repeats=2)
    flops = 2.0 * 2 * 4 * (8 + 16)
    assert flops / 0.04 < rate <= flops / 0.02  # a slow kernel at either shape: <= flops / 0.06


@settings(max_examples=40, derandomize=True, deadline=None)
@given(rates=st.lists(st.tuples(st.floats(1e3, 1e12), st.floats(1e3, 1e15)), min_size=1, max_size=4))
def test_probes_combine_into_the_fastest_rate_of_each_kind(rates):
    probes = [Floors(read_bytes_per_s=r, gemm_flop_per_s=g, footprint=FOOTPRINT) for r, g in rates]
    combined = probes[0]
    for probe in probes[1:]:
        combined = combined.faster(probe)
    assert combined.read_bytes_per_s == max(r for r, _ in rates)
    assert combined.gemm_flop_per_s == max(g for _, g in rates)
    assert combined.probes == len(rates) and combined.footprint == FOOTPRINT
    assert combined.as_json()["probes"] == len(rates)
    assert ("the faster of" in combined.describe()) == (len(rates) > 1)


def test_a_probe_of_another_model_is_refused_by_name():
    other = ModelFootprint(matmul_params=1, head_params=1, other_params=0, matmul_shapes={(1, 1): 1}, bytes_per_param=4)
    with pytest.raises(ValueError, match="other"):
        Floors(1e9, 1e9, FOOTPRINT).faster(Floors(1e9, 1e9, other))


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    tps=st.floats(0, 1e4),
    peer=st.floats(1e-3, 1e4),
    floor=st.floats(1e-3, 1e4),
    speedup=st.floats(1, 3),
    fraction=st.floats(0.05, 1),
    need_both=st.booleans(),
)
def test_a_target_is_met_by_both_bars_or_by_either(tps, peer, floor, speedup, fraction, need_both):
    target = Target(peer_speedup=speedup, floor_fraction=fraction, need_both=need_both)
    bars = (tps >= speedup * peer, tps >= fraction * floor)
    check = judge(tps, peer, floor, target)
    assert check["target_met"] == (all(bars) if need_both else any(bars))
    assert check["target"] == target.describe() and ("the lower" in check["target"]) != need_both
    assert check["fraction_of_floor"] == [round(tps / floor, 3), round(peer / floor, 3)]


def test_the_page_targets_judge_its_recorded_runs():
    # docs/data/serving_float32_avx2.json: run 5 (68.9 against 50.5 under a floor of 76.1) is 90 %
    # of its floor, above the lower bar; run 3 (95.7 against 71.8 under 155.4) is below both.
    assert judge(68.9, 50.5, 76.1, THROUGHPUT_TARGET)["target_met"]
    assert not judge(95.7, 71.8, 155.4, THROUGHPUT_TARGET)["target_met"]
    assert judge(68.9, 50.5, 76.1, THROUGHPUT_TARGET)["target_tokens_per_s"] == 60.9
    # One stream needs both: 2.25x vLLM at 86 % of its floor, and not 2.25x at 50 %.
    assert judge(28.3, 12.6, 32.9, SINGLE_STREAM_TARGET)["target_met"]
    assert not judge(28.3, 12.6, 56.6, SINGLE_STREAM_TARGET)["target_met"]
    for name in ("peer_tps", "floor_tps"):
        with pytest.raises(ValueError, match=name):
            THROUGHPUT_TARGET.tokens_per_s(0.0 if name == "peer_tps" else 1.0, 0.0 if name == "floor_tps" else 1.0)


def test_bench_judges_the_median_engine_pass_against_the_faster_peer_by_the_workloads_target():
    engine = [("engine, pass 1", 100.0), ("engine, pass 2", 160.0), ("engine, pass 3", 150.0)]
    peer = [("vLLM (defaults)", 60.0), ("vLLM (all-cores-bound)", 100.0)]
    batch = bench.engine_verdict(engine, peer, floor_tps=180.0, single_stream=False)
    assert batch["against"] == "vLLM (all-cores-bound)" and batch["ratio"] == 1.5
    assert batch["target_tokens_per_s"] == 144.0 and batch["target_met"]  # 80 % of the floor, the lower bar
    one = bench.engine_verdict(engine, peer, floor_tps=180.0, single_stream=True)
    assert one["target_tokens_per_s"] == 150.0 and one["target_met"]  # 1.5x, the higher bar
    assert not bench.engine_verdict(engine, peer, floor_tps=300.0, single_stream=True)["target_met"]
    assert bench.engine_verdict(engine, [], floor_tps=180.0, single_stream=False) == {}


def test_bench_gives_every_row_as_a_fraction_of_the_workloads_floor(monkeypatch, capsys, tmp_path):
    # Two probes, each slow at one rate: the table's floor takes the faster of each, the second
    # probe measured after every timed run.
    calls = []
    probes = iter([Floors(1e9, 5e8, FOOTPRINT), Floors(5e8, 1e9, FOOTPRINT)])
    monkeypatch.setattr(bench, "measure_floors", lambda *a: calls.append("floors") or next(probes))
    monkeypatch.setattr(bench, "workload_floor", lambda *a: 600.0)

    def timed(watch, tps, name):
        calls.append(name)
        watch.before()
        watch.after()
        return tps

    monkeypatch.setattr(
        bench, "bench_engine", lambda *a, watch, more_workloads, **kw: ([timed(watch, 300.0, "engine")], 2.5)
    )
    monkeypatch.setattr(bench, "bench_transformers", lambda *a: timed(a[-1], 60.0, "transformers"))
    out = tmp_path / "bench.json"
    bench.main(["--num-requests", "3", "--hf-batch-sizes", "2", "--hf-dtypes", "float32", "--json", str(out)])
    text = capsys.readouterr().out
    assert calls == ["floors", "engine", "transformers", "floors"]
    assert "the faster of 2 probes, before and after the runs): memory read 1.0 GB/s" in text
    assert "matmul 1 GFLOP/s" in text and "of floor" in text
    assert json.loads(out.read_text())["floors"]["gemm_gflop_per_s"] == 1.0
    cells = next(line for line in text.splitlines() if line.startswith("engine ")).split()
    assert cells[cells.index("300.0") :][:3] == ["300.0", "5.00x", "50%"]
    rows = json.loads(out.read_text())["rows"]
    assert [r["fraction_of_floor"] for r in rows] == [0.5, 0.1]
