"""Exercises 03.2, 03.3a, 03.3b of 03_prefix_cache: your versions of prefix_block_manager.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 03_prefix_cache/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from block_manager import Block, BlockManager
from sequence import Sequence


def get_computed_blocks(self, seq: Sequence) -> list[int]:
    """Physical blocks holding the longest cached prefix of ``seq`` (a pure lookup).

    At most :meth:`max_hit_blocks`. Only a sequence holding no blocks can take hits (they are
    attached at its start).

    Becomes ``PrefixCachingBlockManager.get_computed_blocks`` (a method: ``self`` is the
    PrefixCachingBlockManager). Call parent methods as ``Parent.method(self, ...)``, not
    ``super()``.

    Hint: Walk self.block_hashes(seq) up to self.max_hit_blocks(seq) blocks; stop at the first
    hash missing from self.cached_block_hash_to_block or whose block holds other token ids (a
    collision is a miss).

    Checked by: pytest 03_prefix_cache/ --impl=student --exercise 03.2
    """
    raise NotImplementedError(
        "Exercise 03.2: implement PrefixCachingBlockManager.get_computed_blocks — see 03_prefix_cache/README.md#exercises"
    )


def cache_full_blocks(self, seq: Sequence) -> None:
    """Register the blocks of ``seq`` that are full and computed but not yet registered.

    If another block already holds the same hash (two sequences computed the same prefix
    at the same time), this one stays unregistered and is simply freed later.

    Becomes ``PrefixCachingBlockManager.cache_full_blocks`` (a method: ``self`` is the
    PrefixCachingBlockManager). Call parent methods as ``Parent.method(self, ...)``, not
    ``super()``.

    Hint: Only blocks below num_computed_tokens // block_size are full and computed; start after
    the ones this sequence already registered (seq.num_registered_blocks, which you then
    advance); skip a hash another block already holds.

    Checked by: pytest 03_prefix_cache/ --impl=student --exercise 03.3a
    """
    raise NotImplementedError(
        "Exercise 03.3a: implement PrefixCachingBlockManager.cache_full_blocks — see 03_prefix_cache/README.md#exercises"
    )


def _allocate_block(self) -> Block:
    """Evict lazily: drop a free block's hash only when the block is reused

    Becomes ``PrefixCachingBlockManager._allocate_block`` (a method: ``self`` is the
    PrefixCachingBlockManager). Call parent methods as ``Parent.method(self, ...)``, not
    ``super()``.

    Hint: Take a block with BlockManager._allocate_block(self); if it still carries a hash,
    remove that hash from self.cached_block_hash_to_block, clear block_hash and token_ids, and
    count an eviction.

    Checked by: pytest 03_prefix_cache/ --impl=student --exercise 03.3b
    """
    raise NotImplementedError(
        "Exercise 03.3b: implement PrefixCachingBlockManager._allocate_block — see 03_prefix_cache/README.md#exercises"
    )
