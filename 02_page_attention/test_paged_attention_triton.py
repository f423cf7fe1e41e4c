"""The Triton paged-attention kernels equal the torch paths and dense attention.

Without a GPU they run in Triton's interpreter (the root conftest sets TRITON_INTERPRET=1), so the
shapes are tiny but chosen to hit every edge: uneven lengths, a length of 1, lengths ending on and
just past a block boundary, shuffled physical blocks, garbage in every unused slot and table
entry, GQA groups of 1, 4 and 6, cached context before the new tokens, block sizes that are not
powers of two, and a head_dim that is not one either. Where the kernels are compiled (a CUDA
machine) the same tests run them on CUDA tensors (``triton_setup.KERNEL_DEVICE``) against the same
CPU references.
"""

import contextlib

import pytest
import torch

from attention_backends import AttentionMetadata, paged_attention
from paged_attention import dense_attention_reference, paged_attention_decode, paged_attention_varlen
from paged_attention_triton import paged_attention_decode_triton, paged_attention_varlen_triton
from test_paged_attention import TOL, assert_each_sequence_matches_dense, build_paged, decode_batch
from triton_setup import KERNEL_DEVICE


def _cu(q_lens):
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)


def _on_kernel_device(kernel, *args, **kwargs):
    """``kernel`` with its tensor arguments where the kernels run; the result back on the CPU."""
    return kernel(*(a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args), **kwargs).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2), (6, 1)])
def test_decode_triton_matches_torch_and_dense(dtype, num_q_heads, num_kv_heads):
    q, k_cache, v_cache, bt, lens, ks, vs = decode_batch(num_q_heads, num_kv_heads, dtype, seed=11)
    out = _on_kernel_device(paged_attention_decode_triton, q, k_cache, v_cache, bt, lens, 32**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(
        out.float(), paged_attention_decode(q, k_cache, v_cache, bt, lens, 32**-0.5).float(), **TOL[dtype]
    )
    assert_each_sequence_matches_dense(out, q, ks, vs, 32**-0.5, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_triton_with_cached_context_matches_dense(dtype):
    # (new tokens, total tokens): a fresh prompt, a chunk after cached context, a decode row, a
    # prompt ending on a block boundary, a one-token prompt, and a prompt longer than one q tile.
    shapes = [(13, 13), (5, 21), (1, 9), (16, 32), (1, 1), (19, 19)]
    hq, hkv, d, bs = 4, 2, 16, 4
    kv_lens, q_lens = [kv for _, kv in shapes], [ql for ql, _ in shapes]
    k_cache, v_cache, bt, ks, vs = build_paged(kv_lens, hkv, d, bs, dtype, seed=13)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(14)).to(dtype)
    cu, lens = _cu(q_lens), torch.tensor(kv_lens, dtype=torch.int32)
    out = _on_kernel_device(paged_attention_varlen_triton, q, k_cache, v_cache, cu, lens, bt, d**-0.5)
    torch.testing.assert_close(
        out.float(), paged_attention_varlen(q, k_cache, v_cache, cu, lens, bt, d**-0.5).float(), **TOL[dtype]
    )
    for b in range(len(shapes)):
        ref = dense_attention_reference(q[cu[b] : cu[b + 1]], ks[b], vs[b], causal=True, scale=d**-0.5)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].float(), ref.float(), **TOL[dtype])


def test_varlen_triton_without_causal_mask_sees_every_key():
    k_cache, v_cache, bt, ks, vs = build_paged([6, 11], 1, 8, 4, torch.float32, seed=15)
    q = torch.randn(9, 2, 8, generator=torch.Generator().manual_seed(16))
    cu, lens = _cu([6, 3]), torch.tensor([6, 11], dtype=torch.int32)
    out = _on_kernel_device(paged_attention_varlen_triton, q, k_cache, v_cache, cu, lens, bt, 0.5, causal=False)
    torch.testing.assert_close(out[:6], dense_attention_reference(q[:6], ks[0], vs[0], causal=False, scale=0.5))
    torch.testing.assert_close(out[6:], dense_attention_reference(q[6:], ks[1], vs[1], causal=False, scale=0.5))


def test_odd_block_size_and_head_dim_and_garbage_table_entries():
    # block_size 6 and head_dim 24 are not powers of two; the padding entries of the block table
    # point far outside the cache, so reading one would fault or return garbage.
    kv_lens, hq, hkv, d, bs = [5, 12, 13, 25], 4, 2, 24, 6
    k_cache, v_cache, bt, ks, vs = build_paged(kv_lens, hkv, d, bs, torch.float32, seed=17)
    bt = torch.where(bt < 0, torch.full_like(bt, 10**6), bt)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    g = torch.Generator().manual_seed(18)
    q_dec = torch.randn(len(kv_lens), hq, d, generator=g)
    out_dec = _on_kernel_device(paged_attention_decode_triton, q_dec, k_cache, v_cache, bt, lens, d**-0.5)
    q_lens = [5, 4, 1, 7]
    q_var = torch.randn(sum(q_lens), hq, d, generator=g)
    cu = _cu(q_lens)
    out_var = _on_kernel_device(paged_attention_varlen_triton, q_var, k_cache, v_cache, cu, lens, bt, d**-0.5)
    for b in range(len(kv_lens)):
        ref = dense_attention_reference(q_dec[b : b + 1], ks[b], vs[b], scale=d**-0.5)
        torch.testing.assert_close(out_dec[b : b + 1], ref, **TOL[torch.float32])
        ref = dense_attention_reference(q_var[cu[b] : cu[b + 1]], ks[b], vs[b], scale=d**-0.5)
        torch.testing.assert_close(out_var[cu[b] : cu[b + 1]], ref, **TOL[torch.float32])


def test_strided_q_from_a_fused_qkv_and_varlen_decode_rows_equal_decode_kernel():
    # Queries sliced out of a fused QKV projection are strided views; all-decode varlen batches
    # must give what the decode kernel gives.
    kv_lens, hq, hkv, d, bs = [3, 9, 4], 4, 2, 16, 4
    k_cache, v_cache, bt, _, _ = build_paged(kv_lens, hkv, d, bs, torch.float32, seed=19)
    qkv = torch.randn(len(kv_lens), (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(20))
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    ref = paged_attention_decode(qkv[:, : hq * d].view(-1, hq, d), k_cache, v_cache, bt, lens, 0.3)
    # Moved before slicing: moving a strided view would make a contiguous copy of it.
    qkv, k_cache, v_cache, bt, lens = (t.to(KERNEL_DEVICE) for t in (qkv, k_cache, v_cache, bt, lens))
    q = qkv[:, : hq * d].view(-1, hq, d)
    assert not q.is_contiguous()
    dec = paged_attention_decode_triton(q, k_cache, v_cache, bt, lens, 0.3).cpu()
    cu = _cu([1, 1, 1]).to(KERNEL_DEVICE)
    var = paged_attention_varlen_triton(q, k_cache, v_cache, cu, lens, bt, 0.3, max_seqlen_q=1).cpu()
    torch.testing.assert_close(dec, ref)
    torch.testing.assert_close(var, dec)


def test_triton_bad_arguments_raise_value_error_naming_them():
    k_cache = torch.zeros(4, 4, 2, 8)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention_decode_triton(torch.zeros(1, 3, 8), k_cache, k_cache, bt, one, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        paged_attention_decode_triton(torch.zeros(1, 2, 16), k_cache, k_cache, bt, one, 1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention_decode_triton(torch.zeros(1, 2, 8, dtype=torch.bfloat16), k_cache, k_cache, bt, one, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode_triton(torch.zeros(1, 2, 8), k_cache, k_cache, bt, torch.tensor([0]), 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode_triton(torch.zeros(1, 2, 8), k_cache, k_cache, bt, torch.tensor([9]), 1.0)
    with pytest.raises(ValueError, match="seq_lens_k"):
        paged_attention_varlen_triton(torch.zeros(3, 2, 8), k_cache, k_cache, _cu([3]), torch.tensor([2]), bt, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_varlen_triton(torch.zeros(3, 2, 8), k_cache, k_cache, _cu([2]), torch.tensor([2]), bt, 1.0)


@contextlib.contextmanager
def _no_reads_back_to_the_host(monkeypatch):
    """Fail on any read of a tensor's values into Python: on a GPU, a sync that stalls the CPU
    until every queued kernel has run. CUDA has a detector for it; on the CPU nothing syncs, so
    the Python conversions every such read goes through (``int(t)``, ``bool(t)``, ``t.item()``,
    ``t.tolist()``) raise instead.
    """

    def refuse(self, *args, **kwargs):
        raise RuntimeError("a synchronizing read of a tensor's value back to the host")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, refuse)
        if KERNEL_DEVICE == "cuda":
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if KERNEL_DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode(previous)


def test_decode_step_reads_nothing_back_given_the_host_side_lengths(monkeypatch):
    # The engine's decode step calls the decode kernel in every layer: given max_seqlen_k, which the
    # batch builder knows as a Python int, neither the wrapper nor the dispatcher reads a length
    # back; the varlen wrapper neither, given max_seqlen_q too.
    kv_lens, hq, hkv, d, bs = [5, 12, 9], 4, 2, 16, 4
    k_cache, v_cache, bt, _, _ = build_paged(kv_lens, hkv, d, bs, torch.float32, seed=21)
    g = torch.Generator().manual_seed(22)
    q, q_var = torch.randn(3, hq, d, generator=g), torch.randn(9, hq, d, generator=g)
    lens, cu = torch.tensor(kv_lens, dtype=torch.int32), _cu([4, 1, 4])
    ref_dec = paged_attention_decode(q, k_cache, v_cache, bt, lens, 0.3)
    ref_var = paged_attention_varlen(q_var, k_cache, v_cache, cu, lens, bt, 0.3)
    q, q_var, k_cache, v_cache, bt, lens, cu = (t.to(KERNEL_DEVICE) for t in (q, q_var, k_cache, v_cache, bt, lens, cu))
    no_slots = torch.full((3,), -1, device=KERNEL_DEVICE)
    md = AttentionMetadata(no_slots, _cu([1, 1, 1]).to(KERNEL_DEVICE), lens, bt, max_seqlen_q=1, max_seqlen_k=12)
    with _no_reads_back_to_the_host(monkeypatch):
        dec = paged_attention_decode_triton(q, k_cache, v_cache, bt, lens, 0.3, max_seqlen_k=12)
        engine_dec = paged_attention(q, k_cache, v_cache, md, 0.3, backend="triton")
        var = paged_attention_varlen_triton(q_var, k_cache, v_cache, cu, lens, bt, 0.3, max_seqlen_q=4, max_seqlen_k=12)
    torch.testing.assert_close(dec.cpu(), ref_dec)
    torch.testing.assert_close(engine_dec.cpu(), ref_dec)
    torch.testing.assert_close(var.cpu(), ref_var)
    # The detector detects: without the bound the wrapper checks the lengths themselves.
    with pytest.raises(RuntimeError, match="synchronizing"), _no_reads_back_to_the_host(monkeypatch):
        paged_attention_decode_triton(q, k_cache, v_cache, bt, lens, 0.3)


def test_host_side_bound_is_checked_against_the_block_table():
    k_cache = torch.zeros(4, 4, 2, 8)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_k 9"):
        paged_attention_decode_triton(torch.zeros(1, 2, 8), k_cache, k_cache, bt, one, 1.0, max_seqlen_k=9)
