"""bench_decode_cpu.py times what it says: a valid decode batch, the bytes it reads, a consistent report."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bench_decode_cpu
from paged_attention import paged_attention_decode
from paged_attention_cpu import cpu_kernel_available, paged_attention_decode_cpu


def args_for(**overrides) -> object:
    argv = ["--no-progress"]
    for name, value in overrides.items():
        argv += [f"--{name.replace('_', '-')}", *(str(v) for v in (value if isinstance(value, tuple) else (value,)))]
    return bench_decode_cpu.parse_args(argv)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    seqs=st.integers(1, 5),
    lo=st.integers(1, 40),
    extra=st.integers(0, 40),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    block_size=st.integers(1, 17),
    layers=st.integers(1, 3),
    blocks=st.sampled_from(["scattered", "in-order"]),
)
def test_each_sequence_owns_its_blocks_and_the_bytes_are_its_tokens(
    seqs, lo, extra, kv_heads, group, block_size, layers, blocks
):
    args = args_for(
        seqs=seqs,
        context=(lo, lo + extra),
        kv_heads=kv_heads,
        q_heads=kv_heads * group,
        head_dim=16,
        block_size=block_size,
        layers=layers,
        blocks=blocks,
    )
    batch = bench_decode_cpu.decode_batch(args)
    tables, lens = batch["block_tables"], batch["lens"]
    assert tables.shape == (seqs, -(-(lo + extra) // block_size))
    assert sorted(tables.flatten().tolist()) == list(range(batch["k"][0].shape[0]))  # no block shared
    if blocks == "in-order":
        assert tables.flatten().tolist() == list(range(tables.numel()))
    assert all(lo <= n <= lo + extra for n in lens.tolist())
    # Bytes counted slot by slot: every token of every sequence, K and V, each layer.
    slots = sum(min(block_size, n - b * block_size) for n in lens.tolist() for b in range(-(-n // block_size)))
    assert bench_decode_cpu.kv_bytes(batch) == slots * kv_heads * 16 * 2 * 2 * layers


@pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel could not be built here")
def test_the_timed_batch_is_one_the_kernel_attends_correctly():
    args = args_for(seqs=3, context=(20, 50), layers=2)
    batch = bench_decode_cpu.decode_batch(args)
    scale = args.head_dim**-0.5
    for q, k, v in zip(batch["q"], batch["k"], batch["v"]):
        out = paged_attention_decode_cpu(q, k, v, batch["block_tables"], batch["lens"], scale)
        reference = paged_attention_decode(q, k, v, batch["block_tables"], batch["lens"], scale)
        torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernel could not be built here")
def test_the_report_and_the_json_agree_with_the_bytes_and_times(tmp_path, capsys):
    path = tmp_path / "out.json"
    bench_decode_cpu.main(
        ["--seqs", "2", "--context", "30", "60", "--layers", "2", "--reps", "3", "--no-progress", "--json", str(path)]
    )
    result = json.loads(path.read_text())
    assert result["step_gb_per_s"] == pytest.approx(result["kv_bytes"] / (result["step_ms"] / 1e3) / 1e9)
    assert result["read_gb_per_s"] == pytest.approx(result["kv_bytes"] / (result["read_ms"] / 1e3) / 1e9)
    assert result["fraction_of_read"] == pytest.approx(result["read_ms"] / result["step_ms"])
    out = capsys.readouterr().out
    assert f"{result['step_ms']:8.3f} ms a step" in out and f"{result['kv_bytes'] / 1e6:.1f} MB" in out


def test_bad_shapes_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench_decode_cpu.parse_args(["--q-heads", "8", "--kv-heads", "3"])
    assert "--q-heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_decode_cpu.parse_args(["--context", "50", "20"])
    assert "--context" in capsys.readouterr().err
