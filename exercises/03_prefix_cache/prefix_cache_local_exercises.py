"""Exercises 03.1, 03.6 of 03_prefix_cache: your versions of prefix_cache_local.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 03_prefix_cache/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence as SequenceABC

import xxhash

from prefix_cache_local import NONE_HASH, BlockHash, CachedBlock, _encode_extra_keys


def compute_block_hash(
    parent_hash: BlockHash | None, token_ids: SequenceABC[int], extra_keys: tuple | None = None
) -> BlockHash:
    """Hash one full block: ``xxh3_128(parent_hash || n || token ids as int64 || extra keys)``.

    The parent hash chains the block to its whole prefix; ``None`` means "first block" and uses
    :data:`NONE_HASH`. The token count is encoded so no two (tokens, extra keys) pairs can
    produce the same byte string. Returns 16 bytes, identical in every process and machine.

    Hint: Concatenate the parent hash (NONE_HASH for the first block), the token count and the
    token ids packed as little-endian int64 (struct.pack), and the encoded extra keys
    (_encode_extra_keys); return xxhash.xxh3_128_digest of it. Never Python's hash(). A parent
    that is neither None nor 16 bytes is a ValueError.

    Checked by: pytest 03_prefix_cache/ --impl=student --exercise 03.1
    """
    raise NotImplementedError("Exercise 03.1: implement compute_block_hash — see 03_prefix_cache/README.md#exercises")


def match_prefix(
    self, token_ids: list[int], extra_keys: tuple | None = None, cache_salt: str | None = None
) -> tuple[list[CachedBlock], int]:
    """The cached blocks holding the longest prefix of ``token_ids``, and its token count.

    A lookup only: it refreshes the LRU position of the hits but takes no reference
    (call :meth:`touch`). A hash hit whose token ids differ (a collision) counts as a miss.

    Becomes ``PrefixCacheLocal.match_prefix`` (a method: ``self`` is the PrefixCacheLocal). Call
    parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Hash the chain, then walk it while each hash is cached; count queries and hits.

    Checked by: pytest 03_prefix_cache/ --impl=student --exercise 03.6
    """
    raise NotImplementedError(
        "Exercise 03.6: implement PrefixCacheLocal.match_prefix — see 03_prefix_cache/README.md#exercises"
    )
