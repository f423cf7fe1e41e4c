def get_computed_blocks(self, seq):
    """Trusts the hash alone: a block whose token ids differ (a collision) is taken as a hit."""
    if seq.block_table:
        return []
    hits = []
    for block_hash in self.block_hashes(seq)[: self.max_hit_blocks(seq)]:
        block_id = self.cached_block_hash_to_block.get(block_hash)
        if block_id is None:
            break
        hits.append(block_id)
    return hits
