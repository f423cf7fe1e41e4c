"""The engine's float32 GEMM (``layers/f32_gemm.cpp``) against float64 products, on shapes drawn at
random: the row count crosses its tile (4 rows, 3 column blocks of 8) and the L2 prefetch of the
next tile (more than one row tile) and the bands of rows it splits a wide x into, and neither
dimension need be a multiple of anything; then that a float32 layer takes it for every matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_from_scratch.layers import f32_gemm
from vllm_from_scratch.layers.linear import ReplicatedLinear

needs_gemm = pytest.mark.skipif(not f32_gemm.gemm_available(), reason="this CPU has no AVX2 and FMA")


@needs_gemm
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rows=st.integers(0, 40),
    out_features=st.integers(1, 100),
    in_features=st.integers(1, 90),
    with_bias=st.booleans(),
    leading=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 2**16),
)
def test_matches_the_products_summed_exactly(rows, out_features, in_features, with_bias, leading, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(*leading, rows, in_features, generator=g)
    packed = f32_gemm.pack(weight)
    assert packed.shape == (-(-out_features // 8), in_features, 8)
    out = f32_gemm.linear(x, packed, bias, out_features)
    assert out.dtype == torch.float32 and out.shape == (*leading, rows, out_features)
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # A float32 sum of in_features products taken in order: its rounding grows with their count.
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-6 * in_features)


@needs_gemm
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 80),
    out_features=st.integers(1, 60),
    in_features=st.integers(1500, 4100),
    seed=st.integers(0, 2**16),
)
def test_rows_in_several_bands_match_the_exact_products(rows, out_features, in_features, seed):
    """A band of x's rows is as many as fit 256 KB (f32_gemm.cpp): 16 to 40 rows at these
    widths, so most draws cross one or more bands, some ending in a partial row tile."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    out = f32_gemm.linear(x, f32_gemm.pack(weight), bias, out_features)
    reference = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-6 * in_features)


@needs_gemm
def test_columns_past_out_features_are_not_written():
    """The last block of 8 columns is stored lane by lane: a row of 13 outputs must hold its own
    sums and nothing of the zero padding, which the next row's start would show."""
    weight = torch.arange(13 * 5, dtype=torch.float32).reshape(13, 5)
    x = torch.ones(6, 5)
    out = f32_gemm.linear(x, f32_gemm.pack(weight), torch.ones(13), 13)
    assert torch.equal(out, (weight.sum(1) + 1).expand(6, 13))


@needs_gemm
def test_a_strided_input_gives_what_its_contiguous_copy_gives():
    weight = torch.randn(48, 64)
    wide = torch.randn(5, 128)
    packed = f32_gemm.pack(weight)
    assert torch.equal(
        f32_gemm.linear(wide[:, ::2], packed, None, 48), f32_gemm.linear(wide[:, ::2].contiguous(), packed, None, 48)
    )


@needs_gemm
def test_bad_arguments_raise_value_errors_naming_them():
    weight = torch.randn(32, 16)
    packed = f32_gemm.pack(weight)
    with pytest.raises(ValueError, match="weight"):
        f32_gemm.pack(weight.bfloat16())
    with pytest.raises(ValueError, match="in_features"):
        f32_gemm.linear(torch.randn(2, 18), packed, None, 32)
    with pytest.raises(ValueError, match="out_features"):
        f32_gemm.linear(torch.randn(2, 16), packed, None, 33)
    with pytest.raises(ValueError, match="float32"):
        f32_gemm.linear(torch.randn(2, 16).bfloat16(), packed, None, 32)
    with pytest.raises(ValueError, match="bias"):
        f32_gemm.linear(torch.randn(2, 16), packed, torch.zeros(31), 32)


@needs_gemm
def test_the_operator_traces_with_its_fake_shape():
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.packed = f32_gemm.pack(torch.randn(40, 24))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return f32_gemm.linear(x, self.packed, None, 40)

    layer = Layer()
    rows = torch.export.Dim("rows", min=1, max=64)
    program = torch.export.export(layer, (torch.randn(3, 24),), dynamic_shapes=({0: rows},), strict=False)
    assert "vllm_fs_f32_gemm.linear" in str(program.graph)
    x = torch.randn(7, 24)
    assert torch.equal(program.module()(x), layer(x))


@needs_gemm
@settings(max_examples=10, deadline=None, derandomize=True)
@given(rows=st.integers(1, 600))
def test_a_float32_layer_takes_the_kernel_at_every_row_count(rows):
    """One matmul path at every row count, and no oneDNN copy of the weight beside it."""
    layer = ReplicatedLinear(24, 40, bias=False)
    layer.weight.data.normal_()
    assert layer.prepack() and layer.gemm_weight is not None and layer.packed_weight is None
    calls = []
    kernel = f32_gemm.linear
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(f32_gemm, "linear", lambda *args: calls.append(args) or kernel(*args))
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer.matmul(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1
