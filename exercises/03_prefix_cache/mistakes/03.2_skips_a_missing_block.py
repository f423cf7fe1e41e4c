def get_computed_blocks(self, seq):
    """Steps over a missing block and keeps matching: a block is useless without every block before it."""
    if seq.block_table:
        return []
    hits = []
    for i, block_hash in enumerate(self.block_hashes(seq)[: self.max_hit_blocks(seq)]):
        block_id = self.cached_block_hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block(i)):
            continue
        hits.append(block_id)
    return hits
