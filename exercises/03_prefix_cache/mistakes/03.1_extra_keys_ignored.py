import struct

import xxhash

from prefix_cache_local import NONE_HASH


def compute_block_hash(parent_hash, token_ids, extra_keys=None):
    """Leaves the extra keys (cache salt, LoRA id) out of the hash, so tenants and adapters share blocks."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    if not isinstance(parent, bytes) or len(parent) != 16:
        raise ValueError(f"parent_hash must be a 16-byte block hash or None, got {parent_hash!r}")
    n = len(token_ids)
    payload = b"".join((parent, struct.pack(f"<Q{n}q", n, *token_ids)))
    return xxhash.xxh3_128_digest(payload)
