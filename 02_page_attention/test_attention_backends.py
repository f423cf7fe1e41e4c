"""The dispatcher picks the backend the tensors allow and every backend gives the same answer."""

import pytest
import torch

from attention_backends import AttentionMetadata, select_backend
from attention_backends import paged_attention as dispatch
from flash_attention import HAS_FLASH_ATTN
from paged_attention import paged_attention_decode, paged_attention_varlen
from paged_attention_cpu import cpu_kernel_available, paged_attention_decode_cpu, paged_attention_varlen_cpu
from test_paged_attention import build_paged
from triton_setup import KERNEL_DEVICE


def _batch(q_lens, kv_lens, dtype=torch.float32, device="cpu", hq=4, hkv=2, d=16, bs=4, seed=31):
    k_cache, v_cache, bt, _, _ = build_paged(kv_lens, hkv, d, bs, dtype, seed=seed)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, cu, lens, bt)]


def paged_attention(q, kc, vc, cu, lens, bt, scale, max_seqlen_q, backend="auto"):
    """The dispatcher on the batch's record (nothing to store: the K/V is in the cache already)."""
    md = AttentionMetadata(torch.full((q.shape[0],), -1, device=q.device), cu, lens, bt, max_seqlen_q)
    return dispatch(q, kc, vc, md, scale, backend)


def test_auto_on_cpu_picks_the_cpp_kernel_where_it_builds_and_equals_its_parts():
    q, kc, vc, cu, lens, bt = _batch([5, 1, 3], [9, 6, 3])
    expected = "cpp" if cpu_kernel_available() else "torch"
    assert select_backend(q, kc) == expected
    assert select_backend(q.double(), kc.double()) == "torch"  # a dtype the kernel was not compiled for
    cpp = expected == "cpp"
    torch.testing.assert_close(
        paged_attention(q, kc, vc, cu, lens, bt, 0.25, max_seqlen_q=5),
        (paged_attention_varlen_cpu if cpp else paged_attention_varlen)(q, kc, vc, cu, lens, bt, 0.25),
        rtol=0,
        atol=0,
    )
    q, kc, vc, cu, lens, bt = _batch([1, 1, 1], [9, 6, 3])
    torch.testing.assert_close(
        paged_attention(q, kc, vc, cu, lens, bt, 0.25, max_seqlen_q=1),
        (paged_attention_decode_cpu if cpp else paged_attention_decode)(q, kc, vc, bt, lens, 0.25),
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        paged_attention(q, kc, vc, cu, lens, bt, 0.25, max_seqlen_q=1, backend="torch"),
        paged_attention_decode(q, kc, vc, bt, lens, 0.25),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("q_lens,kv_lens", [([5, 1, 3], [9, 6, 3]), ([1, 1, 1], [9, 6, 13])])
def test_triton_backend_equals_torch(q_lens, kv_lens):
    # The Triton kernels run where they can (triton_setup.KERNEL_DEVICE), the torch path on the CPU.
    q, kc, vc, cu, lens, bt = _batch(q_lens, kv_lens, device=KERNEL_DEVICE)
    out = paged_attention(q, kc, vc, cu, lens, bt, 0.25, max_seqlen_q=max(q_lens), backend="triton")
    q, kc, vc, cu, lens, bt = _batch(q_lens, kv_lens)
    ref = paged_attention(q, kc, vc, cu, lens, bt, 0.25, max_seqlen_q=max(q_lens), backend="torch")
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)


def test_unknown_backend_and_flash_without_gpu_are_refused():
    q, kc, vc, cu, lens, bt = _batch([2], [2])
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, kc, vc, cu, lens, bt, 0.25, max_seqlen_q=2, backend="xformers")
    if not HAS_FLASH_ATTN:
        with pytest.raises(RuntimeError, match="flash-attn"):
            paged_attention(q, kc, vc, cu, lens, bt, 0.25, max_seqlen_q=2, backend="flash")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 16), (torch.bfloat16, 256), (torch.float32, 256)])
def test_auto_on_cuda_picks_flash_only_where_it_can_page(dtype, block_size):
    q, kc, vc, cu, lens, bt = _batch([3, 1], [300, 20], dtype=dtype, device="cuda", d=64, bs=block_size)
    expected = "flash" if HAS_FLASH_ATTN and dtype != torch.float32 and block_size % 256 == 0 else "triton"
    assert select_backend(q, kc) == expected
    out = paged_attention(q, kc, vc, cu, lens, bt, 0.125, max_seqlen_q=3)
    ref = paged_attention(q, kc, vc, cu, lens, bt, 0.125, max_seqlen_q=3, backend="torch")
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
