"""Paged KV-cache bookkeeping: physical blocks, reference counts and per-sequence block tables.

The GPU (or CPU) memory for K/V is carved into ``num_blocks`` fixed-size blocks of
``block_size`` token slots. A sequence owns a *block table*: logical block ``i`` of the sequence
lives in physical block ``block_table[i]``, so a sequence grows one block at a time and never
needs contiguous memory. Token position ``p`` of a sequence is written to *slot*
``block_table[p // block_size] * block_size + p % block_size`` of the flat cache.

The interface is token-level, in the style of vLLM V1: :meth:`BlockManager.allocate_slots`
makes room for the next ``n`` tokens after ``seq.num_computed_tokens``. That single call serves a
whole prompt, one chunk of a prompt (chapter 06), one decode token, or ``k + 1`` speculative
tokens (chapter 05). nano-vllm's names (``can_allocate``/``allocate`` for a prompt,
``can_append``/``may_append`` for a decode step, ``deallocate``) are kept as thin wrappers.

Chapter 03 adds prefix caching by subclassing: it overrides :meth:`get_computed_blocks`,
:meth:`cache_full_blocks` and the two block hooks :meth:`_allocate_block` and
:meth:`_touch_block`. Free blocks wait in an ordered queue (least recently freed first), which is
already the LRU order that eviction of cached blocks wants.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from sequence import Sequence, cdiv  # cdiv is re-exported: later chapters import it from here


class Block:
    """One physical KV block.

    ``ref_count`` counts the sequences whose block tables hold it (more than one when a prefix
    is shared). ``block_hash`` and ``token_ids`` are only set by chapter 03's prefix cache.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hashed={self.block_hash is not None})"


class BlockManager:
    """Hands out KV blocks to sequences and takes them back.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: token slots per block.

    Invariant: every block is either in ``free_block_ids`` with ``ref_count == 0`` or in
    ``used_block_ids`` with ``ref_count > 0``; :meth:`check_invariants` asserts it.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # An ordered set: pop from the head, O(1) removal from the middle (a prefix hit on a
        # freed-but-cached block takes it back out of the queue).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()

    # ------------------------------------------------------------------ accounting
    def get_num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (vLLM's ``kv_cache_usage_perc``)."""
        return len(self.used_block_ids) / self.num_blocks

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Blocks to add so that ``seq`` can hold ``num_new_tokens`` tokens past its computed ones.

        ``num_hit_blocks`` prefix-cache hits (chapter 03) are attached before the new tokens.
        """
        total_tokens = seq.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(total_tokens, self.block_size) - len(seq.block_table) - num_hit_blocks)

    # ------------------------------------------------------------------ token-level API
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Physical blocks already holding a prefix of ``seq`` (none without prefix caching).

        A pure lookup: nothing is reserved until :meth:`allocate_slots` succeeds.
        """
        return []

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Collection[int] = ()) -> bool:
        return self._num_blocks_to_take(seq, num_new_tokens, computed_blocks) <= self.get_num_free_blocks()

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Collection[int] = ()) -> bool:
        """Extend ``seq.block_table`` to cover ``num_new_tokens`` more tokens.

        ``computed_blocks`` (from :meth:`get_computed_blocks`) are attached first; the caller then
        advances ``seq.num_computed_tokens`` by ``len(computed_blocks) * block_size``. Returns
        False and changes nothing when there are not enough free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not self.can_allocate_slots(seq, num_new_tokens, computed_blocks):
            return False
        num_new_blocks = self.num_new_blocks_needed(seq, num_new_tokens, len(computed_blocks))
        for block_id in computed_blocks:
            self._touch_block(self.blocks[block_id])
            seq.block_table.append(block_id)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._allocate_block().block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Called after a forward pass advanced ``seq.num_computed_tokens``.

        A no-op here; chapter 03 registers the blocks that just became full in the prefix cache.
        """

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq``; a shared block is only freed by its last holder.

        Blocks are released tail first, so the end of a prefix chain is evicted before its start
        (a later request can only hit a block if it also hits every block before it).
        """
        for block_id in reversed(seq.block_table):
            self._release_block(self.blocks[block_id])
        seq.block_table.clear()

    # ------------------------------------------------------------------ nano-vllm's names
    def can_allocate(self, seq: Sequence) -> bool:
        """Can the whole of ``seq`` (its prompt, before any decode) get blocks now?"""
        computed = self.get_computed_blocks(seq)
        return self.can_allocate_slots(seq, self._uncached_tokens(seq, computed), computed)

    def allocate(self, seq: Sequence) -> None:
        """Give the whole of ``seq`` its blocks, reusing prefix-cache hits."""
        if seq.block_table:
            raise ValueError("allocate() expects a sequence that holds no blocks")
        computed = self.get_computed_blocks(seq)
        if not self.allocate_slots(seq, self._uncached_tokens(seq, computed), computed):
            raise RuntimeError("not enough free KV blocks: check can_allocate() first")
        seq.num_cached_tokens = len(computed) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens

    def can_append(self, seq: Sequence) -> bool:
        """Can ``seq`` take the tokens it holds beyond its computed ones (one, when decoding)?"""
        return self.can_allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)

    def may_append(self, seq: Sequence) -> None:
        if not self.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
            raise RuntimeError("not enough free KV blocks: check can_append() first")

    def deallocate(self, seq: Sequence) -> None:
        self.free(seq)

    # ------------------------------------------------------------------ slots
    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat cache slots of token positions ``[start, end)`` of ``seq``."""
        bs = self.block_size
        if end > len(seq.block_table) * bs:
            raise ValueError(f"positions up to {end} need {cdiv(end, bs)} blocks, seq has {len(seq.block_table)}")
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    # ------------------------------------------------------------------ block hooks
    def _uncached_tokens(self, seq: Sequence, computed: list[int]) -> int:
        return seq.num_tokens - seq.num_computed_tokens - len(computed) * self.block_size

    def _num_blocks_to_take(self, seq: Sequence, num_new_tokens: int, computed_blocks: Collection[int]) -> int:
        # A hit on a block nobody holds takes it out of the free queue too.
        idle_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return self.num_new_blocks_needed(seq, num_new_tokens, len(computed_blocks)) + idle_hits

    def _allocate_block(self) -> Block:
        """Take the least recently freed block."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, block
        block.ref_count = 1
        self.used_block_ids.add(block_id)
        return block

    def _touch_block(self, block: Block) -> None:
        """Add a holder to an existing block (a prefix-cache hit)."""
        if block.ref_count == 0:
            del self.free_block_ids[block.block_id]
            self.used_block_ids.add(block.block_id)
        block.ref_count += 1

    def _release_block(self, block: Block) -> None:
        assert block.ref_count > 0, block
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_block_ids.discard(block.block_id)
            self.free_block_ids[block.block_id] = None

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert the free/used partition and reference counts are consistent (for tests)."""
        free, used = set(self.free_block_ids), self.used_block_ids
        assert not free & used, f"blocks both free and used: {free & used}"
        assert len(free) + len(used) == self.num_blocks, "a block is neither free nor used"
        for b in self.blocks:
            assert (b.ref_count == 0) == (b.block_id in free), b

    def all_blocks_free(self) -> bool:
        """True when no live sequence holds a block (cached blocks with refcount 0 count as free)."""
        return not self.used_block_ids and self.get_num_free_blocks() == self.num_blocks
