"""BlockManager: allocation, reference counts, token-level slots, and that no block is ever lost."""

import random
from collections import Counter

import pytest

from block_manager import BlockManager, cdiv
from sequence import Sequence


def _prefilled(tokens, bm):
    """A sequence given its prompt's blocks and marked computed, as after a prefill step."""
    seq = Sequence(tokens, block_size=bm.block_size)
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def test_fresh_manager_is_all_free():
    bm = BlockManager(8, 4)
    bm.check_invariants()
    assert bm.all_blocks_free() and bm.get_num_free_blocks() == 8 and bm.usage == 0.0


def test_allocate_gives_ceil_blocks_and_free_returns_them_tail_first():
    bm = BlockManager(8, 16)
    seq = Sequence(range(33), block_size=16)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[b].ref_count for b in range(4)] == [1, 1, 1, 0]
    assert bm.get_num_free_blocks() == 5 and bm.usage == 3 / 8
    bm.check_invariants()
    bm.free(seq)
    assert seq.block_table == [], f"free leaves the table empty, got {seq.block_table}"
    assert bm.all_blocks_free()
    # Tail first: block 2 was freed before block 0, so it sits earlier in the LRU queue.
    assert list(bm.free_block_ids)[-3:] == [2, 1, 0], (
        f"free queue ends {list(bm.free_block_ids)[-3:]}: blocks go back tail first, so a prefix chain's end "
        "is reused before its start"
    )
    bm.check_invariants()


def test_shared_block_is_freed_by_its_last_holder():
    bm = BlockManager(6, 4)
    a = _prefilled(range(8), bm)
    b = Sequence(list(range(4)) + [99, 98], block_size=4)
    shared = a.block_table[:1]  # what chapter 03's prefix cache would report as a hit
    assert bm.allocate_slots(b, 2, shared)
    b.num_computed_tokens += 4
    assert b.block_table[0] == a.block_table[0] and len(b.block_table) == 2
    assert bm.blocks[shared[0]].ref_count == 2, "a prefix hit adds a holder to the block (self._touch_block)"
    bm.free(a)
    assert bm.blocks[shared[0]].ref_count == 1 and shared[0] in bm.used_block_ids, (
        f"block {shared[0]} is still held by b: freeing a drops one reference, it does not free the block "
        f"(ref_count {bm.blocks[shared[0]].ref_count})"
    )
    bm.check_invariants()
    bm.free(b)
    assert bm.all_blocks_free()
    bm.check_invariants()


def test_hit_on_an_idle_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(3, 4)
    idle = 1  # a block nobody holds (chapter 03: freed but still cached)
    seq = Sequence(range(9), block_size=4)
    # 1 hit + 5 new tokens = 9 tokens = 3 blocks: 2 new ones plus the idle hit leaves the queue.
    assert bm.can_allocate_slots(seq, 5, [idle])
    assert bm.allocate_slots(seq, 5, [idle])
    assert seq.block_table[0] == idle and bm.get_num_free_blocks() == 0, (
        f"the hit on idle block {idle} must take it out of the free queue (self._touch_block), or it would be "
        f"handed out again; free blocks left: {list(bm.free_block_ids)}"
    )
    bm.check_invariants()
    bm.free(seq)
    assert bm.all_blocks_free()


def test_failed_allocation_changes_nothing():
    bm = BlockManager(4, 4)
    holder = _prefilled(range(8), bm)  # takes 2 of 4 blocks
    seq = Sequence(range(12), block_size=4)
    assert not bm.can_allocate(seq)
    free_before, table_before = list(bm.free_block_ids), list(holder.block_table)
    assert bm.allocate_slots(seq, 12) is False
    assert seq.block_table == [] and list(bm.free_block_ids) == free_before, (
        f"a failed allocation must change nothing (check can_allocate_slots first); the sequence kept "
        f"{seq.block_table} and the free queue is {list(bm.free_block_ids)}, was {free_before}"
    )
    # A partial request on a sequence that already holds blocks fails whole, too.
    assert bm.allocate_slots(holder, 9) is False
    assert holder.block_table == table_before and list(bm.free_block_ids) == free_before
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(seq)
    assert seq.block_table == []
    bm.check_invariants()


def test_token_level_allocate_slots_grows_chunk_by_chunk():
    bm = BlockManager(10, 4)
    seq = Sequence(range(13), block_size=4)
    for chunk, blocks in [(5, 2), (3, 2), (5, 4)]:  # chunked prefill: 5 + 3 + 5 tokens
        assert bm.allocate_slots(seq, chunk)
        assert len(seq.block_table) == blocks, (
            f"after {seq.num_computed_tokens} + {chunk} tokens the table needs {blocks} blocks of 4, has "
            f"{len(seq.block_table)}: a chunk first fills the room left in the last block"
        )
        seq.num_computed_tokens += chunk
    assert bm.allocate_slots(seq, 0) and len(seq.block_table) == 4
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots(seq, -1)


@pytest.mark.parametrize("prompt_len,needs_block", [(16, True), (17, False), (31, False), (32, True)])
def test_can_append_at_block_boundaries(prompt_len, needs_block):
    bm = BlockManager(cdiv(prompt_len, 16), 16)  # exactly the prompt's blocks: none left over
    seq = _prefilled(range(prompt_len), bm)
    seq.append_token(7)  # the sampled token, whose K/V the next decode step writes
    assert bm.get_num_free_blocks() == 0
    assert bm.can_append(seq) is (not needs_block)
    if needs_block:
        with pytest.raises(RuntimeError, match="can_append"):
            bm.may_append(seq)
    else:
        bm.may_append(seq)
        assert len(seq.block_table) == cdiv(prompt_len, 16)


def test_may_append_takes_a_new_block_only_on_the_boundary():
    bm = BlockManager(4, 4)
    seq = _prefilled(range(4), bm)
    seq.append_token(1)
    bm.may_append(seq)
    seq.num_computed_tokens += 1
    assert len(seq.block_table) == 2
    for _ in range(3):
        seq.append_token(1)
        bm.may_append(seq)
        seq.num_computed_tokens += 1
    assert len(seq.block_table) == 2  # positions 5..7 fit in block 2
    bm.deallocate(seq)
    assert bm.all_blocks_free()


def test_slot_mapping_follows_the_block_table():
    bm = BlockManager(8, 4)
    seq = Sequence(range(10), block_size=4)
    # Scattered and out of order, as a table is after other sequences came and went: logical
    # block i lives wherever block_table[i] says, never at block_table[0] + i.
    seq.block_table = [7, 2, 5]
    slots = bm.slot_mapping(seq, 0, 10)
    for p, slot in enumerate(slots):
        block, offset = seq.block_table[p // 4], p % 4
        assert slot == block * 4 + offset, (
            f"position {p} is offset {offset} of logical block {p // 4}, which is physical block "
            f"{block} (block_table={seq.block_table}): slot {block * 4 + offset}, not {slot}"
        )
    assert slots == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert bm.slot_mapping(seq, 9, 10) == [21]
    with pytest.raises(ValueError, match="blocks"):
        bm.slot_mapping(seq, 0, 13)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    with pytest.raises(ValueError, match="token_ids"):
        Sequence([])
    with pytest.raises(ValueError, match="block_size"):
        Sequence([1], block_size=0)
    bm = BlockManager(4, 4)
    seq = _prefilled(range(3), bm)
    with pytest.raises(ValueError, match="allocate"):
        bm.allocate(seq)


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_loses_a_block(seed):
    """Admit, share prefixes, chunk, decode, preempt and finish at random; check every step."""
    rng = random.Random(seed)
    bm = BlockManager(24, 4)
    running: list[Sequence] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.25:
            seq = Sequence([rng.randrange(50) for _ in range(rng.randint(1, 20))], block_size=4)
            donors = [s for s in running if s.num_computed_tokens >= 4]
            hits = []
            if donors and rng.random() < 0.5:  # pretend a prefix-cache hit on a donor's full blocks
                donor = rng.choice(donors)
                hits = donor.block_table[: rng.randint(1, donor.num_computed_tokens // 4)]
                hits = hits[: (seq.num_tokens - 1) // 4]
            chunk = rng.randint(1, seq.num_tokens - len(hits) * 4)
            if bm.allocate_slots(seq, chunk, hits):
                seq.num_computed_tokens = len(hits) * 4 + chunk
                running.append(seq)
        elif op < 0.8 and running:
            seq = rng.choice(running)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(50))
            n = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)
            if bm.allocate_slots(seq, n):
                seq.num_computed_tokens += n
            else:  # preempt by recompute: give everything back
                bm.free(seq)
                running.remove(seq)
        elif running:
            seq = running.pop(rng.randrange(len(running)))
            bm.free(seq)
        bm.check_invariants()
        holders = Counter(b for s in running for b in s.block_table)
        assert all(bm.blocks[b].ref_count == c for b, c in holders.items())
        assert set(holders) == bm.used_block_ids
        assert all(len(s.block_table) == cdiv(s.num_computed_tokens, 4) for s in running)
    for seq in running:
        bm.free(seq)
    assert bm.all_blocks_free()
    bm.check_invariants()
