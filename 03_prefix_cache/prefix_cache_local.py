"""A single-machine prefix cache: chained block hashes, reference counts, LRU eviction.

Many requests start with the same tokens (a system prompt, a few-shot preamble, the history of
a chat). Their K/V for those tokens is identical, so it can be computed once and shared. The
cache works on *full blocks* of ``BLOCK_SIZE`` tokens: a block is identified by a hash of its
token ids *and of everything before it* (the parent block's hash), so equal hashes mean equal
prefixes, and looking up a prompt is a walk down its chain of hashes until the first miss.

This module is a standalone model of the idea (``PrefixCacheLocal``), with no block manager
under it; chapter 03's ``PrefixCachingBlockManager`` applies the same hashing to chapter 01's paged block manager, which
is what the engine runs. The hash functions here are shared by both, and by the global KV pool,
so they must give the same answer in every process: they use xxHash over a canonical byte
encoding, never Python's ``hash()`` (salted per process for str/bytes).
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC

import xxhash

BLOCK_SIZE = 16  # tokens per block

# The parent of a chain's first block. A fixed constant (vLLM's NONE_HASH is random per process
# unless PYTHONHASHSEED is set) so that two engines hash the same prompt to the same chain.
NONE_HASH: bytes = xxhash.xxh3_128_digest(b"vllm-from-scratch/prefix-cache/v1")

BlockHash = bytes  # a 16-byte xxh3_128 digest


def _encode_extra_keys(extra_keys) -> bytes:
    """Canonical bytes for extra keys (LoRA id, cache salt, ...): JSON of str/int/float/None."""
    if extra_keys is None:
        return b""
    try:
        return json.dumps(list(extra_keys), separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra_keys must be a tuple of str/int/float/None, got {extra_keys!r}") from exc


def compute_block_hash(
    parent_hash: BlockHash | None, token_ids: SequenceABC[int], extra_keys: tuple | None = None
) -> BlockHash:
    """Hash one full block: ``xxh3_128(parent_hash || n || token ids as int64 || extra keys)``.

    The parent hash chains the block to its whole prefix; ``None`` means "first block" and uses
    :data:`NONE_HASH`. The token count is encoded so no two (tokens, extra keys) pairs can
    produce the same byte string. Returns 16 bytes, identical in every process and machine.
    """
    parent = NONE_HASH if parent_hash is None else parent_hash
    if not isinstance(parent, bytes) or len(parent) != 16:
        raise ValueError(f"parent_hash must be a 16-byte block hash or None, got {parent_hash!r}")
    n = len(token_ids)
    payload = b"".join((parent, struct.pack(f"<Q{n}q", n, *token_ids), _encode_extra_keys(extra_keys)))
    return xxhash.xxh3_128_digest(payload)


def block_extra_keys(block_index: int, lora_id: int | str | None = None, cache_salt: str | None = None) -> tuple | None:
    """Extra keys of block ``block_index``: the LoRA id on every block, the salt on block 0 only.

    The salt only needs to enter the first block: every later hash inherits it through the chain.
    """
    keys = []
    if lora_id is not None:
        keys.append(lora_id)
    if cache_salt is not None and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def hash_block_chain(
    token_ids: SequenceABC[int],
    block_size: int = BLOCK_SIZE,
    parent_hash: BlockHash | None = None,
    start_block: int = 0,
    lora_id: int | str | None = None,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from logical block ``start_block`` on.

    ``parent_hash`` is the hash of block ``start_block - 1`` (``None`` when starting at 0), which
    is what lets a caller extend a chain incrementally as a sequence grows.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent_hash = compute_block_hash(parent_hash, block, block_extra_keys(i, lora_id, cache_salt))
        hashes.append(parent_hash)
    return hashes


class CachedBlock:
    """One cached block: its id, its chained hash, the token ids it holds, and its holders."""

    __slots__ = ("block_id", "block_hash", "token_ids", "ref_cnt")

    def __init__(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]):
        self.block_id = block_id
        self.block_hash = block_hash
        self.token_ids = token_ids
        self.ref_cnt = 0  # requests currently using this block

    def __repr__(self) -> str:
        return f"CachedBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash.hex()[:8]})"


class PrefixCacheLocal:
    """A prefix cache of at most ``max_cached_blocks`` blocks with LRU eviction.

    The cache maps chained block hashes to :class:`CachedBlock`\\ s in an ``OrderedDict`` kept in
    least-recently-used order. Requests :meth:`touch` the blocks they use and :meth:`release`
    them when done; only blocks nobody holds (``ref_cnt == 0``) can be evicted. Hits are counted
    in tokens, like vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``.

    Args:
        max_cached_blocks: capacity. When every cached block is in use, new blocks are simply
            not cached (their K/V is used by its request and then dropped).
    """

    def __init__(self, max_cached_blocks: int):
        if max_cached_blocks <= 0:
            raise ValueError(f"max_cached_blocks must be positive, got {max_cached_blocks}")
        self.max_cached_blocks = max_cached_blocks
        self.next_block_id = 0
        self._cache: OrderedDict[BlockHash, CachedBlock] = OrderedDict()  # LRU first
        self._active_blocks: dict[int, CachedBlock] = {}  # blocks with ref_cnt > 0
        self._total_count = 0  # prompt tokens looked up
        self._hit_count = 0  # of which found in the cache
        self.num_evictions = 0

    def _allocate_block_id(self) -> int:
        bid = self.next_block_id
        self.next_block_id += 1
        return bid

    def compute_hash_chain(
        self, token_ids: list[int], extra_keys: tuple | None = None, cache_salt: str | None = None
    ) -> list[tuple[BlockHash, tuple[int, ...]]]:
        """``[(block_hash, block_tokens), ...]`` for every *full* block of ``token_ids``.

        ``extra_keys`` enter every block's hash; ``cache_salt`` only the first block's.
        """
        result = []
        parent = None
        for i in range(len(token_ids) // BLOCK_SIZE):
            tokens = tuple(token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            keys = tuple(extra_keys or ()) + ((cache_salt,) if cache_salt is not None and i == 0 else ())
            parent = compute_block_hash(parent, tokens, keys or None)
            result.append((parent, tokens))
        return result

    def match_prefix(
        self, token_ids: list[int], extra_keys: tuple | None = None, cache_salt: str | None = None
    ) -> tuple[list[CachedBlock], int]:
        """The cached blocks holding the longest prefix of ``token_ids``, and its token count.

        A lookup only: it refreshes the LRU position of the hits but takes no reference
        (call :meth:`touch`). A hash hit whose token ids differ (a collision) counts as a miss.
        """
        matched = []
        for block_hash, tokens in self.compute_hash_chain(token_ids, extra_keys, cache_salt):
            cached = self._cache.get(block_hash)
            if cached is None or cached.token_ids != tokens:
                break  # the chain is broken: later blocks cannot be reused either
            self._cache.move_to_end(block_hash)
            matched.append(cached)
        num_cached_tokens = len(matched) * BLOCK_SIZE
        self._total_count += len(token_ids)
        self._hit_count += num_cached_tokens
        return matched, num_cached_tokens

    def touch(self, blocks: list[CachedBlock]) -> None:
        """A request starts using ``blocks``: they cannot be evicted until released."""
        for block in blocks:
            block.ref_cnt += 1
            self._active_blocks[block.block_id] = block

    def release(self, blocks: list[CachedBlock]) -> None:
        """A request is done with ``blocks``; unreferenced ones become evictable."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"release of a block nobody holds: {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._active_blocks.pop(block.block_id, None)

    def cache_computed_blocks(
        self, token_ids: list[int], extra_keys: tuple | None = None, cache_salt: str | None = None
    ) -> list[CachedBlock]:
        """Register the full blocks of ``token_ids`` (called once their K/V is computed).

        Returns the cached blocks of the chain, reused or new. If the cache is full of blocks in
        use, registration stops there: a chain with a hole in it could never be hit past it.
        """
        blocks = []
        for block_hash, tokens in self.compute_hash_chain(token_ids, extra_keys, cache_salt):
            existing = self._cache.get(block_hash)
            if existing is not None:
                if existing.token_ids != tokens:
                    break  # a hash collision: keep the first owner, stop the chain
                self._cache.move_to_end(block_hash)
                blocks.append(existing)
                continue
            while len(self._cache) >= self.max_cached_blocks:
                if not self._evict_lru():
                    return blocks
            block = CachedBlock(self._allocate_block_id(), block_hash, tokens)
            self._cache[block_hash] = block
            blocks.append(block)
        return blocks

    def _evict_lru(self) -> bool:
        """Drop the least recently used block that nobody holds; False if all are held."""
        for block_hash, block in self._cache.items():
            if block.ref_cnt == 0:
                del self._cache[block_hash]
                self.num_evictions += 1
                return True
        return False

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    @property
    def cache_hit_rate(self) -> float:
        """Hit tokens over looked-up tokens, across every :meth:`match_prefix` call so far."""
        return self._hit_count / max(1, self._total_count)
