"""The KV cache tensor: sizing it from a memory budget, allocating it, and mapping tokens to slots.

One tensor holds every layer's keys and values::

    kv_cache[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
             │      │          │           │
             │      │          │           └─ token slot inside a block
             │      │          └─ physical block (what a block table points at)
             │      └─ layer
             └─ 0 = keys, 1 = values

``kv_cache[0, l]`` and ``kv_cache[1, l]`` are layer ``l``'s ``k_cache`` / ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``: flash-attn's paged layout, so the same
views feed the torch, Triton and flash-attn attention paths of chapter 02. Flattening the first
two dimensions of a layer view gives ``[num_blocks * block_size, kv_heads, head_dim]``, indexed by
*slot* ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import torch


def _check_positive(**kwargs: int) -> None:
    for name, value in kwargs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16
) -> int:
    """Bytes one block costs across all layers: 2 (K and V) × layers × block_size × heads × head_dim × itemsize."""
    _check_positive(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def num_blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
) -> int:
    """How many whole blocks fit in ``budget_bytes`` (nano-vllm's ``allocate_kv_cache`` divides
    ``total × gpu_memory_utilization − used − (peak − current)`` by the block's bytes: the card's
    share, less what is in use, less the transient peak of a warm-up step at the largest batch)."""
    if not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    return budget_bytes // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Allocate the zeroed ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` cache.

    Zeroed rather than ``empty`` so that a slot read before it is written is a visible zero in a
    test, not yesterday's memory.
    """
    _check_positive(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def build_slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, seq_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Slots of token ``positions`` given each sequence's block table, without a Python loop.

    Args:
        block_tables: ``[batch, max_blocks]`` integer block tables (padding past a sequence's
            blocks may hold anything, it is never read for a valid position).
        positions: token positions. Either ``[batch]`` (one token per sequence: decode) or
            ``[num_tokens]`` together with ``seq_ids``.
        block_size: tokens per block.
        seq_ids: ``[num_tokens]`` row of ``block_tables`` each position belongs to; ``None``
            means row ``i`` for position ``i``. A negative position maps to slot ``-1``
            ("do not store", e.g. padding).

    Returns:
        ``[num_tokens]`` int64 slots ``block_tables[s, p // block_size] * block_size + p % block_size``.
    """
    _check_positive(block_size=block_size)
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [batch, max_blocks], got shape {tuple(block_tables.shape)}")
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    if seq_ids is None:
        if positions.numel() != block_tables.shape[0]:
            raise ValueError("positions must have one entry per block_tables row when seq_ids is None")
        seq_ids = torch.arange(positions.numel(), device=positions.device)
    elif seq_ids.shape != positions.shape:
        raise ValueError(f"seq_ids must match positions' shape {tuple(positions.shape)}")
    positions = positions.long()
    valid = positions >= 0
    safe_pos = positions.clamp(min=0)
    logical_block = safe_pos // block_size
    if bool((logical_block[valid] >= block_tables.shape[1]).any()):
        raise ValueError("a position lies past its sequence's block table")
    physical = block_tables.long()[seq_ids.long(), logical_block]
    slots = physical * block_size + safe_pos % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))
