"""Writing the K/V of new tokens into their cache slots.

After the QKV projection of a forward pass, token ``i`` of the batch has ``key[i]`` and
``value[i]`` (``[num_kv_heads, head_dim]`` each) and one *slot* ``slot_mapping[i]`` computed by the
block manager. Storing is a scatter::

    k_cache.view(num_slots, kv_heads, head_dim)[slot_mapping[i]] = key[i]     (same for V)

A slot of ``-1`` means "do not store": padding rows (CUDA-graph batches padded to a captured
size) and tokens whose K/V is already cached.

Two implementations with one signature: :func:`store_kvcache_torch` (an ``index_copy_``, the CPU
path) and :func:`store_kvcache_triton` (one Triton program per token, the GPU path; it runs under
``TRITON_INTERPRET=1`` on a CPU). :func:`store_kvcache` picks one by device.
"""

from __future__ import annotations

import torch

from triton_setup import HAS_TRITON, tl, triton  # before any other triton import


def _check_args(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.dim() != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"key, value, k_cache and v_cache must share a dtype, got {key.dtype}, "
            f"{value.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (views of the KV cache tensor are)")


def store_kvcache_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into the slots ``slot_mapping``.

    ``k_cache``/``v_cache`` are one layer's ``[num_blocks, block_size, kv_heads, head_dim]``
    tensors, written in place. Slots equal to ``-1`` are skipped.
    """
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping.long()
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())} but the cache has {num_slots} slots")
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slots, value)


if HAS_TRITON:

    @triton.jit
    def _store_kvcache_kernel(
        key_ptr,
        key_stride,
        value_ptr,
        value_stride,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per token: copy its D = kv_heads * head_dim values into its slot's row.
        idx = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + idx).to(tl.int64)
        if slot < 0:
            return
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D  # BLOCK_D is D rounded up to a power of two, as tl.arange needs
        key = tl.load(key_ptr + idx * key_stride + offs, mask=mask)
        value = tl.load(value_ptr + idx * value_stride + offs, mask=mask)
        cache_offs = slot * D + offs
        tl.store(k_cache_ptr + cache_offs, key, mask=mask)
        tl.store(v_cache_ptr + cache_offs, value, mask=mask)


def store_kvcache_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as :func:`store_kvcache_torch`, as a Triton kernel (one program per token).

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV output) as long as each
    token's heads are packed: ``stride(2) == 1`` and ``stride(1) == head_dim``.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use store_kvcache_torch")
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = key.shape
    if key.stride(2) != 1 or key.stride(1) != head_dim:
        key = key.contiguous()
    if value.stride(2) != 1 or value.stride(1) != head_dim:
        value = value.contiguous()
    if num_tokens == 0:
        return
    D = num_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key,
        key.stride(0),
        value,
        value.stride(0),
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        D=D,
        BLOCK_D=triton.next_power_of_2(D),
    )


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """What the engine calls: the Triton kernel for CUDA tensors, the torch scatter otherwise."""
    if key.is_cuda and HAS_TRITON:
        store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping)
