"""flash-attn's paged calls equal the torch path (needs an NVIDIA GPU with flash-attn; skipped here).

On a CPU machine only the guard is checked: the module imports, says flash-attn is absent, and its
wrappers refuse to run rather than failing somewhere inside CUDA.
"""

import pytest
import torch

from flash_attention import HAS_FLASH_ATTN, flash_decode, flash_varlen
from paged_attention import paged_attention_decode, paged_attention_varlen
from test_paged_attention import build_paged

needs_flash = pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn is not installed")


def test_wrappers_refuse_cpu_tensors_or_a_missing_flash_attn():
    k_cache = torch.zeros(2, 256, 1, 16, dtype=torch.bfloat16)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    error = ValueError if HAS_FLASH_ATTN else RuntimeError
    with pytest.raises(error):
        flash_decode(torch.zeros(1, 2, 16, dtype=torch.bfloat16), k_cache, k_cache, bt, lens, 1.0)
    with pytest.raises(error):
        flash_varlen(
            torch.zeros(3, 2, 16, dtype=torch.bfloat16),
            k_cache,
            k_cache,
            torch.tensor([0, 3], dtype=torch.int32),
            lens,
            bt,
            1.0,
            3,
            3,
        )


@pytest.mark.cuda
@needs_flash
def test_flash_wrappers_reject_block_sizes_flash_attn_cannot_page():
    k_cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 256"):
        flash_decode(
            torch.zeros(1, 2, 64, dtype=torch.bfloat16, device="cuda"),
            k_cache,
            k_cache,
            torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
            torch.tensor([3], dtype=torch.int32, device="cuda"),
            1.0,
        )


@pytest.mark.cuda
@needs_flash
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_decode_and_varlen_match_torch(dtype):
    # Lengths crossing the 256-token block boundary, cached context before new tokens, GQA 4:1.
    shapes = [(300, 300), (40, 600), (1, 257), (256, 512)]
    hq, hkv, d, bs = 8, 2, 64, 256
    kv_lens, q_lens = [kv for _, kv in shapes], [ql for ql, _ in shapes]
    k_cache, v_cache, bt, _, _ = build_paged(kv_lens, hkv, d, bs, dtype, seed=21)
    k_cache, v_cache, bt = k_cache.cuda(), v_cache.cuda(), bt.cuda()
    g = torch.Generator().manual_seed(22)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype).cuda()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    out = flash_varlen(q, k_cache, v_cache, cu, lens, bt, d**-0.5, max(q_lens), max(kv_lens))
    ref = paged_attention_varlen(q, k_cache, v_cache, cu, lens, bt, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    q1 = torch.randn(len(kv_lens), hq, d, generator=g).to(dtype).cuda()
    out = flash_decode(q1, k_cache, v_cache, bt, lens, d**-0.5)
    ref = paged_attention_decode(q1, k_cache, v_cache, bt, lens, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
