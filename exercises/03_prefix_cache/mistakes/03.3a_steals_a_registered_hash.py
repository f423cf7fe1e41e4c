def cache_full_blocks(self, seq):
    """Registers a hash another block already holds: the map moves to the newcomer, orphaning the first."""
    num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
    if num_full <= seq.num_registered_blocks:
        return
    hashes = self.block_hashes(seq)
    for i in range(seq.num_registered_blocks, num_full):
        block = self.blocks[seq.block_table[i]]
        if block.block_hash is not None:
            continue
        block.block_hash = hashes[i]
        block.token_ids = tuple(seq.block(i))
        self.cached_block_hash_to_block[hashes[i]] = block.block_id
    seq.num_registered_blocks = num_full
