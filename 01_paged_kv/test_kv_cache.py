"""KV cache sizing, allocation and the vectorized slot mapping."""

import pytest
import torch

from kv_cache import allocate_kv_cache, build_slot_mapping, bytes_per_block, num_blocks_for_budget


def test_bytes_per_block_follows_the_formula():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16, blocks of 16 tokens.
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    assert bytes_per_block(1, 1, 1, 1, torch.float32) == 8


def test_num_blocks_for_budget_floors():
    per_block = bytes_per_block(2, 16, 2, 8, torch.float16)
    assert num_blocks_for_budget(10 * per_block + per_block - 1, 2, 16, 2, 8, torch.float16) == 10
    assert num_blocks_for_budget(0, 2, 16, 2, 8, torch.float16) == 0


def test_allocate_kv_cache_shape_and_layer_views():
    cache = allocate_kv_cache(3, 5, 4, 2, 8, torch.bfloat16)
    assert cache.shape == (2, 3, 5, 4, 2, 8) and cache.dtype == torch.bfloat16
    assert cache.count_nonzero() == 0
    k_cache = cache[0, 1]
    assert k_cache.is_contiguous() and k_cache.data_ptr() == cache[0, 1, 0, 0, 0].data_ptr()
    assert cache.numel() * cache.element_size() == 5 * bytes_per_block(3, 4, 2, 8, torch.bfloat16)


@pytest.mark.parametrize(
    "bad", [dict(num_layers=0), dict(num_blocks=-1), dict(block_size=0), dict(num_kv_heads=2.0), dict(head_dim=True)]
)
def test_allocate_rejects_bad_sizes(bad):
    args = dict(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8)
    args.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        allocate_kv_cache(**args)


def test_bad_budget_and_dtype_raise():
    with pytest.raises(ValueError, match="budget_bytes"):
        num_blocks_for_budget(-1, 1, 16, 1, 8)
    with pytest.raises(ValueError, match="dtype"):
        bytes_per_block(1, 16, 1, 8, "float16")


def test_build_slot_mapping_decode_and_prefill():
    block_tables = torch.tensor([[7, 2, -1], [4, 0, 9]], dtype=torch.int32)
    bs = 4
    # decode: one token per sequence
    slots = build_slot_mapping(block_tables, torch.tensor([5, 9]), bs)
    assert slots.tolist() == [2 * 4 + 1, 9 * 4 + 1], (
        f"position 5 of sequence 0 is offset 1 of its logical block 1, physical block 2 (table [7, 2, ...]): "
        f"slot 9, not block_tables[s, 0] * block_size + p; got {slots.tolist()}"
    )
    # prefill/varlen: tokens of both sequences, a -1 position is padding
    positions = torch.tensor([0, 3, 4, -1, 8, 11])
    seq_ids = torch.tensor([0, 0, 0, 0, 1, 1])
    slots = build_slot_mapping(block_tables, positions, bs, seq_ids)
    expected = [
        block_tables[s, p // bs].item() * bs + p % bs if p >= 0 else -1
        for s, p in zip(seq_ids.tolist(), positions.tolist())
    ]
    assert slots.tolist() == expected and slots.dtype == torch.int64, (
        f"got {slots.tolist()} ({slots.dtype}), expected int64 {expected}: each slot is "
        "block_tables[seq, p // block_size] * block_size + p % block_size, and a padding position (-1) is slot -1"
    )


def test_build_slot_mapping_rejects_positions_past_the_table():
    with pytest.raises(ValueError, match="block table"):
        build_slot_mapping(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([8]), 4)
    with pytest.raises(ValueError, match="block_size"):
        build_slot_mapping(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="seq_ids"):
        build_slot_mapping(torch.zeros(2, 2, dtype=torch.int32), torch.tensor([1, 2, 3]), 4, torch.tensor([0, 1]))
