"""Exercises 03.4a, 03.4b of 03_prefix_cache: your versions of global_kv_pool.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 03_prefix_cache/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import json

import torch
import xxhash

from global_kv_pool import _HEADER_LEN, MAGIC, KVBlockCorrupt
from prefix_cache_local import BlockHash


def deserialize_block(
    value: bytes, shape: tuple[int, ...], dtype: torch.dtype, token_ids: tuple[int, ...]
) -> torch.Tensor:
    """Parse and check a stored block; raise :class:`KVBlockCorrupt` unless it is exactly the
    block of ``token_ids`` with this ``shape`` and ``dtype``.

    Hint: Check the length, the magic, the JSON header (shape, dtype, token ids), the payload
    size and its xxh64 checksum, raising KVBlockCorrupt with what was wrong; then view the
    payload bytes as a tensor of that dtype and shape.

    Checked by: pytest 03_prefix_cache/ --impl=student --exercise 03.4a
    """
    raise NotImplementedError("Exercise 03.4a: implement deserialize_block — see 03_prefix_cache/README.md#exercises")


def fetch(
    self,
    block_hashes: list[BlockHash],
    block_token_ids: list[tuple[int, ...]],
    kv_cache: torch.Tensor,
    block_ids: list[int],
) -> int:
    """Load the leading blocks of the chain into ``kv_cache[:, :, block_ids[i]]``.

    Returns how many blocks were loaded: all of them, or fewer when a block is missing or
    invalid (a warning says which). Loading stops at the first bad block, because a later
    block is useless without the K/V of every block before it.

    Becomes ``GlobalKVPool.fetch`` (a method: ``self`` is the GlobalKVPool). Call parent methods
    as ``Parent.method(self, ...)``, not ``super()``.

    Hint: One self.backend.get_many for every key; walk the values in chain order, deserialize
    each (a missing or corrupt block ends the load: self._fault says why), copy it into
    kv_cache[:, :, block_id], and return how many blocks were loaded. A store that fails is a
    fault, never a crash.

    Checked by: pytest 03_prefix_cache/ --impl=student --exercise 03.4b
    """
    raise NotImplementedError("Exercise 03.4b: implement GlobalKVPool.fetch — see 03_prefix_cache/README.md#exercises")
