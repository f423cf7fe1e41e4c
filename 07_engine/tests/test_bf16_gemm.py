"""The engine's bfloat16 GEMM (``layers/bf16_gemm.cpp``) against float32 products, on shapes drawn
at random: the row count crosses its tile sizes (4 and 8 rows, 3 and 4 column blocks of 16), and
neither dimension need be a multiple of anything."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_from_scratch.layers import bf16_gemm

needs_gemm = pytest.mark.skipif(not bf16_gemm.gemm_available(), reason="this CPU has no AVX-512 BF16")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact products summed in float32: what the kernel computes before its one rounding."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@needs_gemm
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rows=st.integers(0, 40),
    out_features=st.integers(1, 130),
    in_features=st.integers(1, 100),
    with_bias=st.booleans(),
    leading=st.sampled_from([(), (2,)]),
    unrounded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_float32_products_rounded_once_or_not_at_all(
    rows, out_features, in_features, with_bias, leading, unrounded, seed
):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    x = torch.randn(*leading, rows, in_features, generator=g).bfloat16()
    packed = bf16_gemm.pack(weight)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    dtype = torch.float32 if unrounded else torch.bfloat16
    out = bf16_gemm.linear(x, packed, bias, out_features, dtype)
    assert out.dtype == dtype and out.shape == (*leading, rows, out_features)
    # A float32 sum taken in another order than the reference's, and rounded once to bfloat16
    # (half a unit in the last of its 8 bits) unless asked for in float32.
    rtol = 1e-5 if unrounded else 2**-8
    torch.testing.assert_close(out.float(), reference(x, weight, bias), rtol=rtol, atol=1e-5 * in_features)


@needs_gemm
def test_columns_past_out_features_are_not_written():
    """The last block of 16 columns is stored through a mask: a row of 17 outputs in a wider
    buffer must leave its neighbours alone, which strided rows of the result would show."""
    weight = torch.ones(17, 8, dtype=torch.bfloat16)
    x = torch.ones(3, 8, dtype=torch.bfloat16)
    out = bf16_gemm.linear(x, bf16_gemm.pack(weight), None, 17)
    assert torch.equal(out, torch.full((3, 17), 8.0, dtype=torch.bfloat16))


@needs_gemm
def test_a_strided_input_gives_what_its_contiguous_copy_gives():
    """Rows sliced out of a wider tensor (the hidden states of the sampled rows) are taken as
    they are: the operator makes them contiguous itself."""
    weight = torch.randn(48, 64).bfloat16()
    wide = torch.randn(5, 128).bfloat16()
    packed = bf16_gemm.pack(weight)
    assert torch.equal(
        bf16_gemm.linear(wide[:, ::2], packed, None, 48), bf16_gemm.linear(wide[:, ::2].contiguous(), packed, None, 48)
    )


@needs_gemm
def test_bad_arguments_raise_value_errors_naming_them():
    weight = torch.randn(32, 16).bfloat16()
    packed = bf16_gemm.pack(weight)
    with pytest.raises(ValueError, match="weight"):
        bf16_gemm.pack(weight.float())
    with pytest.raises(ValueError, match="in_features"):
        bf16_gemm.linear(torch.randn(2, 18).bfloat16(), packed, None, 32)
    with pytest.raises(ValueError, match="out_features"):
        bf16_gemm.linear(torch.randn(2, 16).bfloat16(), packed, None, 33)
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_gemm.linear(torch.randn(2, 16), packed, None, 32)
    with pytest.raises(ValueError, match="bias"):
        bf16_gemm.linear(torch.randn(2, 16).bfloat16(), packed, torch.zeros(31).bfloat16(), 32)
    with pytest.raises(ValueError, match="dtype"):
        bf16_gemm.linear(torch.randn(2, 16).bfloat16(), packed, None, 32, torch.float16)


@needs_gemm
def test_the_operator_traces_with_its_fake_shape():
    """``torch.export`` sees the operator's output shape without running it: how the compiled
    forward includes it."""

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.packed = bf16_gemm.pack(torch.randn(40, 24).bfloat16())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return bf16_gemm.linear(x, self.packed, None, 40)

    layer = Layer()
    rows = torch.export.Dim("rows", min=1, max=64)
    program = torch.export.export(layer, (torch.randn(3, 24).bfloat16(),), dynamic_shapes=({0: rows},), strict=False)
    assert "vllm_fs_gemm.linear" in str(program.graph)
    x = torch.randn(7, 24).bfloat16()
    assert torch.equal(program.module()(x), layer(x))
