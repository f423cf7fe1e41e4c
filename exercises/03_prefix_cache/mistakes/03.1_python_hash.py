def compute_block_hash(parent_hash, token_ids, extra_keys=None):
    """Hashes the tuple with Python's hash(): salted per process for bytes, so two engines never agree on a block."""
    if parent_hash is not None and (not isinstance(parent_hash, bytes) or len(parent_hash) != 16):
        raise ValueError(f"parent_hash must be a 16-byte block hash or None, got {parent_hash!r}")
    value = hash((parent_hash, tuple(token_ids), extra_keys))
    return value.to_bytes(16, "little", signed=True)
