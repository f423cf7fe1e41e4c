"""Chapter 01's paged block manager with automatic prefix caching (vLLM V1's design).

Four overrides turn :class:`block_manager.BlockManager` into a prefix cache, and nothing else
changes: the engine and the scheduler keep calling the same token-level API.

* :meth:`PrefixCachingBlockManager.get_computed_blocks` walks the sequence's chain of block
  hashes and returns the physical blocks that already hold that prefix (verifying token ids, so a
  hash collision is a miss), capped so the last prompt token is always recomputed.
* :meth:`PrefixCachingBlockManager.cache_full_blocks` registers the blocks a forward pass just
  filled, hashing only blocks that are new since the last call.
* A freed block keeps its hash and stays findable while it waits in the free queue; the queue is
  least recently freed first, so eviction is LRU over *unreferenced* blocks only.
* :meth:`PrefixCachingBlockManager._allocate_block` evicts the stale hash of the block it hands
  out, lazily, at the moment the block is reused.
"""

from __future__ import annotations

from collections.abc import Collection

from block_manager import Block, BlockManager
from prefix_cache_local import BlockHash, hash_block_chain
from sequence import Sequence


class PrefixCachingBlockManager(BlockManager):
    """A :class:`BlockManager` whose full, computed blocks are shared by hash.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: token slots per block.

    Statistics, in tokens as in vLLM (``vllm:prefix_cache_queries_total`` / ``..._hits_total``):
    ``prefix_cache_queries`` counts the tokens of every sequence admitted (its first
    :meth:`allocate_slots` while holding no blocks), ``prefix_cache_hits`` those served from the
    cache; ``hit_rate`` is their ratio. ``num_evictions`` counts cached blocks reused for others.

    A sequence may carry a ``lora_id`` attribute (none of this book's sequences do); it enters
    every block hash, and ``seq.cache_salt`` enters the first, so adapters and tenants never
    share K/V.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        super().__init__(num_blocks, block_size)
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ hashing
    def block_hashes(self, seq: Sequence) -> list[BlockHash]:
        """The chained hashes of every full block of ``seq`` (extended incrementally).

        Token ids are append-only, so hashes already computed stay valid; only blocks that
        filled up since the last call are hashed. They are kept on the sequence
        (``seq.block_hashes``), so a preempted sequence re-hits without rehashing.
        """
        if seq.block_size != self.block_size:
            raise ValueError(f"seq.block_size {seq.block_size} != block manager's {self.block_size}")
        hashes = seq.block_hashes
        if len(hashes) < seq.num_tokens // self.block_size:
            hashes.extend(
                hash_block_chain(
                    seq.token_ids,
                    self.block_size,
                    parent_hash=hashes[-1] if hashes else None,
                    start_block=len(hashes),
                    lora_id=getattr(seq, "lora_id", None),
                    cache_salt=seq.cache_salt,
                )
            )
        return hashes

    def max_hit_blocks(self, seq: Sequence) -> int:
        """Most leading blocks of ``seq`` any cache may serve: its last token is always computed,
        because the forward pass must produce its logits to sample the next token."""
        return (seq.num_tokens - 1) // self.block_size

    # ------------------------------------------------------------------ overrides
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Physical blocks holding the longest cached prefix of ``seq`` (a pure lookup).

        At most :meth:`max_hit_blocks`. Only a sequence holding no blocks can take hits (they are
        attached at its start).
        """
        if seq.block_table:
            return []
        hits = []
        for i, block_hash in enumerate(self.block_hashes(seq)[: self.max_hit_blocks(seq)]):
            block_id = self.cached_block_hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block(i)):
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Collection[int] = ()) -> bool:
        admitting = not seq.block_table
        if not super().allocate_slots(seq, num_new_tokens, computed_blocks):
            return False
        if admitting:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are full and computed but not yet registered.

        If another block already holds the same hash (two sequences computed the same prefix
        at the same time), this one stays unregistered and is simply freed later.
        """
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None or hashes[i] in self.cached_block_hash_to_block:
                continue
            block.block_hash = hashes[i]
            block.token_ids = tuple(seq.block(i))
            self.cached_block_hash_to_block[hashes[i]] = block.block_id
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        seq.num_registered_blocks = 0

    def _allocate_block(self) -> Block:
        block = super()._allocate_block()
        if block.block_hash is not None:
            # Lazy eviction: the block's old content stays findable until the moment it is reused.
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
            self.num_evictions += 1
        return block

    # ------------------------------------------------------------------ statistics and checks
    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits over queries, in tokens (0.0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash (in use or waiting in the free queue)."""
        return len(self.cached_block_hash_to_block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no sequence holds a block."""
        if self.used_block_ids:
            return False
        for block_id in self.cached_block_hash_to_block.values():
            self.blocks[block_id].block_hash = None
            self.blocks[block_id].token_ids = ()
        self.cached_block_hash_to_block.clear()
        return True

    def check_invariants(self) -> None:
        super().check_invariants()
        for block_hash, block_id in self.cached_block_hash_to_block.items():
            block = self.blocks[block_id]
            assert block.block_hash == block_hash, f"hash map points at {block} with another hash"
            assert len(block.token_ids) == self.block_size, f"cached {block} is not a full block"
        num_hashed = sum(b.block_hash is not None for b in self.blocks)
        assert num_hashed == len(self.cached_block_hash_to_block), "a hashed block is missing from the map"
