import struct

import xxhash

from prefix_cache_local import NONE_HASH, _encode_extra_keys


def compute_block_hash(parent_hash, token_ids, extra_keys=None):
    """Parent hash (NONE_HASH first), count and ids as little-endian int64, encoded extra keys, then xxh3_128_digest."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    if not isinstance(parent, bytes) or len(parent) != 16:
        raise ValueError(f"parent_hash must be 16 bytes or None, got {parent_hash!r}")
    ids = list(token_ids)
    packed = struct.pack(f"<q{len(ids)}q", len(ids), *ids)
    return xxhash.xxh3_128_digest(parent + packed + _encode_extra_keys(extra_keys))
