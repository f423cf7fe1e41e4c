def get_computed_blocks(self, seq):
    """Takes every full cached block: a fully cached prompt leaves no token to compute logits from."""
    if seq.block_table:
        return []
    hits = []
    for i, block_hash in enumerate(self.block_hashes(seq)):
        block_id = self.cached_block_hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block(i)):
            break
        hits.append(block_id)
    return hits
