"""The allocation example of nano-vllm's reading guide (docs/sources.md, seed 001), step by step.

8 blocks of 4 tokens; A has a 10-token prompt; B shares A's first 8 tokens. B hits A's two full
blocks only once they are registered by hash, which ``cache_full_blocks`` does after the forward
pass that computed them, not ``allocate``.
"""

from prefix_block_manager import PrefixCachingBlockManager
from sequence import Sequence

A_PROMPT = list(range(10))
B_PROMPT = list(range(8)) + [100, 101]


def computed(seq: Sequence) -> None:
    """What the engine does after the forward pass over ``seq``'s prompt."""
    seq.num_computed_tokens = seq.num_tokens


def test_the_guides_example_after_a_is_registered():
    bm = PrefixCachingBlockManager(8, 4)
    a = Sequence(A_PROMPT, 4)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]
    computed(a)
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full; block 2 holds 2 tokens and stays unhashed
    assert bm.num_cached_blocks == 2

    b = Sequence(B_PROMPT, 4)
    bm.allocate(b)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 3)] == [2, 2, 1]
    assert list(bm.free_block_ids) == [4, 5, 6, 7]

    bm.deallocate(a)  # tail first: block 2 is freed, 1 and 0 are still B's
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2]
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [1, 1]
    bm.check_invariants()


def test_before_a_is_registered_b_hits_nothing():
    # B admitted in the same step as A, before A's forward pass: A's K/V is not computed yet.
    bm = PrefixCachingBlockManager(8, 4)
    a, b = Sequence(A_PROMPT, 4), Sequence(B_PROMPT, 4)
    bm.allocate(a)
    bm.allocate(b)
    assert b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
