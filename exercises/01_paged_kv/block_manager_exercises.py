"""Exercises 01.1, 01.2, 01.3 of 01_paged_kv: your versions of block_manager.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 01_paged_kv/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

from collections.abc import Collection

from sequence import Sequence, cdiv


def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Collection[int] = ()) -> bool:
    """Extend ``seq.block_table`` to cover ``num_new_tokens`` more tokens.

    ``computed_blocks`` (from :meth:`get_computed_blocks`) are attached first; the caller then
    advances ``seq.num_computed_tokens`` by ``len(computed_blocks) * block_size``. Returns
    False and changes nothing when there are not enough free blocks.

    Becomes ``BlockManager.allocate_slots`` (a method: ``self`` is the BlockManager). Call
    parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: A negative num_new_tokens is a ValueError. Count the blocks to add with
    self.num_new_blocks_needed; fail (return False, change nothing) when self.can_allocate_slots
    says no; attach computed_blocks with self._touch_block, new ones with self._allocate_block.

    Checked by: pytest 01_paged_kv/ --impl=student --exercise 01.1
    """
    raise NotImplementedError(
        "Exercise 01.1: implement BlockManager.allocate_slots — see 01_paged_kv/README.md#exercises"
    )


def free(self, seq: Sequence) -> None:
    """Return every block of ``seq``; a shared block is only freed by its last holder.

    Blocks are released tail first, so the end of a prefix chain is evicted before its start
    (a later request can only hit a block if it also hits every block before it).

    Becomes ``BlockManager.free`` (a method: ``self`` is the BlockManager). Call parent methods
    as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Walk the block table backwards and hand each block to self._release_block, which only
    frees it when its last holder lets go; then clear the table.

    Checked by: pytest 01_paged_kv/ --impl=student --exercise 01.2
    """
    raise NotImplementedError("Exercise 01.2: implement BlockManager.free — see 01_paged_kv/README.md#exercises")


def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
    """Flat cache slots of token positions ``[start, end)`` of ``seq``.

    Becomes ``BlockManager.slot_mapping`` (a method: ``self`` is the BlockManager). Call parent
    methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: slot = block_table[p // block_size] * block_size + p % block_size: the blocks of a
    sequence are wherever its table says, never block_table[0] + i. A range that ends past the
    table (end > len(block_table) * block_size) is a ValueError saying how many blocks it needs,
    even an empty range.

    Checked by: pytest 01_paged_kv/ --impl=student --exercise 01.3
    """
    raise NotImplementedError(
        "Exercise 01.3: implement BlockManager.slot_mapping — see 01_paged_kv/README.md#exercises"
    )
