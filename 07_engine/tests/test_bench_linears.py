"""bench_linears.py: every matmul path it times computes the same products, over the weights the
engine really multiplies, and each cell's floor is the slower of reading and multiplying."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from bench_linears import (
    engine_weight_order,
    engine_weight_shapes,
    floor_seconds,
    matmul_paths,
    methods_for,
    print_step_order,
    print_table,
    step_order_paths,
    time_step_order,
)
from floors import Floors, ModelFootprint
from vllm_from_scratch.layers import f32_gemm


def test_the_shapes_are_the_engines_fused_weights(tiny_llama_dir):
    shapes = engine_weight_shapes(str(tiny_llama_dir), "float32")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    config = model.config
    layers, hidden = config.num_hidden_layers, config.hidden_size
    head_dim = hidden // config.num_attention_heads
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    # Q, K and V in one weight; gate and up in one; the LM head once.
    assert shapes[(qkv_rows, hidden)] == layers
    assert shapes[(2 * config.intermediate_size, hidden)] == layers
    assert shapes[(config.vocab_size, hidden)] == 1
    linears = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings().weight
    assert sum(o * i * n for (o, i), n in shapes.items()) == sum(w.numel() for w in linears) + head.numel()


def test_the_step_order_is_a_forwards_layer_after_layer_then_the_head(tiny_llama_dir):
    order = engine_weight_order(str(tiny_llama_dir), "float32")
    config = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).config
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layer = [(qkv_rows, hidden), (hidden, config.num_attention_heads * head_dim)]
    layer += [(2 * config.intermediate_size, hidden), (hidden, config.intermediate_size)]
    assert order == layer * config.num_hidden_layers + [(config.vocab_size, hidden)]


@settings(max_examples=30, derandomize=True, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    rows=st.integers(1, 6),
    shapes=st.lists(st.tuples(st.integers(1, 48), st.sampled_from([7, 32, 80])), min_size=0, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_the_step_order_paths_multiply_each_weight_by_an_input_of_its_width(dtype, rows, shapes, seed):
    """Any weights after a first of 48 x 32: every eager path gives each weight's product with an
    input of its width, the same in every path, and one input per width (recovered from the first
    weight's product by least squares, in float32)."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(shape, generator=generator).to(dtype) for shape in [(48, 32), *shapes]]
    paths = step_order_paths(weights, rows)
    assert list(paths) == [m for m in methods_for(dtype) if m in ("packed", "bf16_gemm", "f32_gemm")]
    tolerance = dict(rtol=1.6e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    reference = paths["packed"]()
    for method, run in paths.items():
        outputs = run()
        assert [tuple(o.shape) for o in outputs] == [(rows, w.shape[0]) for w in weights], method
        for out, ref in zip(outputs, reference):
            torch.testing.assert_close(out.double(), ref.double(), **tolerance, msg=method)
    if dtype == torch.float32:
        x32 = torch.linalg.lstsq(weights[0].double(), reference[0].double().T).solution.T
        for w, out in zip(weights, reference):
            if w.shape[1] == 32:
                torch.testing.assert_close(out.double(), x32 @ w.double().T, rtol=1e-4, atol=1e-4)


def test_the_step_order_floor_adds_every_weights_and_the_line_gives_each_path(capsys):
    order = [(48, 32), (32, 80), (48, 32)]
    floors = Floors(read_bytes_per_s=1e9, gemm_flop_per_s=1e12, footprint=ModelFootprint(0, 0, 0, {}, 4))
    results = time_step_order(order, [1, 3], torch.float32, floors)
    assert [r["rows"] for r in results] == [1, 3]
    for r in results:
        assert r["floor_s"] == pytest.approx(sum(floor_seconds(floors, shape, 1, r["rows"], 4) for shape in order))
        assert set(r["seconds"]) == set(step_order_paths([torch.zeros(2, 2)], 1)) and min(r["seconds"].values()) > 0
    print_step_order([{"rows": 16, "floor_s": 0.002, "seconds": {"packed": 0.004, "bf16_gemm": 0.002}}], 269.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("every weight once, in a step's order (269.0 MB)")
    assert out[1] == "  16 rows  packed 4.00 ms [ 50%]  bf16_gemm 2.00 ms [100%]"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5])
def test_every_path_computes_the_same_products(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    weights = [torch.randn(48, 32, generator=generator).to(dtype) for _ in range(2)]
    x = torch.randn(rows, 32, generator=generator).to(dtype)
    expected = [F.linear(x.double(), w.double()) for w in weights]
    paths = matmul_paths(weights, x)
    assert list(paths) == list(methods_for(dtype))
    assert ("f32_gemm" in paths) == (dtype == torch.float32 and f32_gemm.gemm_available())
    # bf16: float32 sums in each path's own order, one bf16 rounding of the result; float32:
    # float32 sums of 32 products.
    tolerance = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for method, run in paths.items():
        outputs = run()
        assert len(outputs) == len(weights), method
        for out, ref in zip(outputs, expected):
            torch.testing.assert_close(out.double(), ref, **tolerance, msg=method)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    read=st.floats(1e6, 1e12),
    gemm=st.floats(1e6, 1e15),
    out_features=st.integers(1, 65536),
    in_features=st.integers(1, 8192),
    count=st.integers(1, 128),
    rows=st.integers(1, 4096),
)
def test_a_cells_floor_is_the_slower_of_reading_and_multiplying(read, gemm, out_features, in_features, count, rows):
    footprint = ModelFootprint(0, 0, 0, {}, 2)
    floors = Floors(read_bytes_per_s=read, gemm_flop_per_s=gemm, footprint=footprint)
    floor = floor_seconds(floors, (out_features, in_features), count, rows, 2)
    reading = count * out_features * in_features * 2 / read
    multiplying = count * 2 * rows * out_features * in_features / gemm
    assert floor == pytest.approx(max(reading, multiplying))
    assert floor_seconds(floors, (out_features, in_features), count, rows + 1, 2) >= floor


def test_the_table_gives_each_path_as_a_fraction_of_the_floor_and_adds_the_shapes_up(capsys):
    seconds = {"F.linear": 0.004, "packed": 0.002, "graph small": 0.001, "graph large": 0.008}
    results = [
        {"shape": [8, 4], "count": 2, "rows": 1, "floor_s": 0.001, "seconds": seconds},
        {"shape": [16, 4], "count": 1, "rows": 1, "floor_s": 0.003, "seconds": seconds},
    ]
    print_table(results, [1], element_size=2, own_gemm=None, templates=frozenset({"small", "logits"}))
    lines = capsys.readouterr().out.splitlines()
    assert "1 rows: the compiled engine runs its small graph" in lines

    def cells(line: str) -> list[tuple[str, str]]:  # (ms, percent of the floor) per path
        return re.findall(r"([\d.]+) \[\s*(\d+)%\]", line)

    first = next(line for line in lines if line.split()[:4] == ["1", "8", "x", "4"])
    assert first.split()[4:6] == ["2", "0.0"]  # 64 two-byte parameters
    assert cells(first) == [("4.00", "25"), ("2.00", "50"), ("1.00", "100"), ("8.00", "12")]
    total = next(line for line in lines if line.split()[1:2] == ["all"])
    assert total.split()[2:4] == ["3", "0.0"]
    assert cells(total) == [("8.00", "50"), ("4.00", "100"), ("2.00", "200"), ("16.00", "25")]


def test_the_table_names_the_path_the_compiled_engine_takes_for_each_row_count(capsys):
    """The small graph up to SMALL_BATCH_TOKENS rows, the large one above; the engine's GEMM in
    every graph but the template's."""
    seconds = {"packed": 0.001}
    rows = [1, 4, 5, 512]
    results = [{"shape": [8, 4], "count": 1, "rows": r, "floor_s": 0.001, "seconds": seconds} for r in rows]
    print_table(results, rows, element_size=4, own_gemm="f32_gemm", templates=frozenset())
    print_table(results, [4, 5], element_size=2, own_gemm="bf16_gemm", templates=frozenset({"small", "logits"}))
    print_table(results, [5], element_size=2, own_gemm=None, templates=frozenset({"small", "logits"}))
    said = [line for line in capsys.readouterr().out.splitlines() if " rows: " in line]
    assert said == [
        "1 rows: the compiled engine runs its small graph, through f32_gemm",
        "4 rows: the compiled engine runs its small graph, through f32_gemm",
        "5 rows: the compiled engine runs its large graph, through f32_gemm",
        "512 rows: the compiled engine runs its large graph, through f32_gemm",
        "4 rows: the compiled engine runs its small graph",
        "5 rows: the compiled engine runs its large graph, through bf16_gemm",
        "5 rows: the compiled engine runs its large graph",
    ]
