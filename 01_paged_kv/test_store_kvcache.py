"""store_kvcache: the torch scatter and the Triton kernel write exactly the same cache.

The Triton kernel runs where kernels run here (``triton_setup.KERNEL_DEVICE``): on CPU tensors in
the interpreter, on CUDA tensors where it is compiled; the torch reference stays on the CPU.
"""

import pytest
import torch

from kv_cache import allocate_kv_cache
from store_kvcache import HAS_TRITON, store_kvcache, store_kvcache_torch, store_kvcache_triton
from triton_setup import KERNEL_DEVICE

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def _inputs(num_tokens, num_blocks=6, block_size=4, heads=2, head_dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    cache = torch.randn(2, 1, num_blocks, block_size, heads, head_dim, generator=g).to(dtype)
    return key, value, cache, slots


@pytest.mark.parametrize("store", [store_kvcache_torch, store_kvcache])
def test_store_writes_each_token_to_its_slot(store):
    key, value, cache, slots = _inputs(7)
    k_cache, v_cache = cache[0, 0], cache[1, 0]
    before = cache.clone()
    store(key, value, k_cache, v_cache, slots)
    bs = k_cache.shape[1]
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // bs, s % bs], key[i]) and torch.equal(v_cache[s // bs, s % bs], value[i]), (
            f"token {i}'s K/V is not in slot {s} (block {s // bs}, offset {s % bs}): the store must write "
            "into the cache itself (a view), not into a copy made by chained indexing or reshape"
        )
    written = torch.zeros(k_cache.shape[0] * bs, dtype=torch.bool)
    written[slots] = True
    untouched = ~written.view(k_cache.shape[:2])
    assert torch.equal(cache[:, 0][:, untouched], before[:, 0][:, untouched])


def test_minus_one_slots_are_skipped():
    key, value, cache, slots = _inputs(6, seed=1)
    slots[[1, 4]] = -1
    before = cache.clone()
    store_kvcache_torch(key, value, cache[0, 0], cache[1, 0], slots)
    flat_before = before[:, 0].reshape(2, -1, *key.shape[1:])
    flat_after = cache[:, 0].reshape(2, -1, *key.shape[1:])
    kept = slots[slots >= 0]
    changed = (flat_after != flat_before).flatten(2).any(-1).any(0)
    assert set(changed.nonzero().flatten().tolist()) <= set(kept.tolist()), (
        f"slots {sorted(set(changed.nonzero().flatten().tolist()) - set(kept.tolist()))} changed though no "
        "token maps there: slot -1 means 'do not store', not the last slot (Python's wrap-around)"
    )
    assert torch.equal(flat_after[0, kept], key[slots >= 0])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim", [(2, 8), (3, 4)])  # D = 16 and D = 12 (not a power of 2)
def test_triton_equals_torch(dtype, heads, head_dim):
    key, value, cache, slots = _inputs(9, heads=heads, head_dim=head_dim, dtype=dtype, seed=2)
    slots[[0, 5]] = -1
    ref = cache.clone()
    store_kvcache_torch(key, value, ref[0, 0], ref[1, 0], slots)
    key, value, cache, slots = (t.to(KERNEL_DEVICE) for t in (key, value, cache, slots))
    store_kvcache_triton(key, value, cache[0, 0], cache[1, 0], slots.to(torch.int32))
    assert torch.equal(cache.cpu(), ref)


@needs_triton
def test_triton_accepts_strided_key_from_fused_qkv():
    heads, head_dim, n = 2, 8, 5
    qkv = torch.randn(n, 3 * heads * head_dim)
    key = qkv[:, heads * head_dim : 2 * heads * head_dim].view(n, heads, head_dim)
    value = qkv[:, 2 * heads * head_dim :].view(n, heads, head_dim)
    assert not key.is_contiguous()
    cache = allocate_kv_cache(1, 4, 4, heads, head_dim, torch.float32)
    ref = cache.clone()
    slots = torch.tensor([3, 0, 9, 15, 4])
    store_kvcache_torch(key, value, ref[0, 0], ref[1, 0], slots)
    qkv, cache, slots = (t.to(KERNEL_DEVICE) for t in (qkv, cache, slots))
    key = qkv[:, heads * head_dim : 2 * heads * head_dim].view(n, heads, head_dim)  # still strided
    value = qkv[:, 2 * heads * head_dim :].view(n, heads, head_dim)
    store_kvcache_triton(key, value, cache[0, 0], cache[1, 0], slots)
    assert torch.equal(cache.cpu(), ref)


def test_store_rejects_bad_arguments():
    key, value, cache, slots = _inputs(4)
    k, v = cache[0, 0], cache[1, 0]
    with pytest.raises(ValueError, match="value"):
        store_kvcache_torch(key, value[:3], k, v, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache_torch(key, value, k, v, slots[:3])
    with pytest.raises(ValueError, match="dtype"):
        store_kvcache_torch(key.half(), value.half(), k, v, slots)
    with pytest.raises(ValueError, match="k_cache"):
        store_kvcache_torch(key, value, k[..., :4], v, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache_torch(key, value, k, v, torch.tensor([0, 1, 2, 10_000]))
