import struct

import xxhash

from prefix_cache_local import _encode_extra_keys


def compute_block_hash(parent_hash, token_ids, extra_keys=None):
    """Hashes only the block's own tokens: the same block after different prefixes gets one hash."""
    n = len(token_ids)
    payload = b"".join((struct.pack(f"<Q{n}q", n, *token_ids), _encode_extra_keys(extra_keys)))
    return xxhash.xxh3_128_digest(payload)
