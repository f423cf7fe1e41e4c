def free(self, seq):
    """Puts every block back in the free queue, even one another sequence still holds."""
    for block_id in reversed(seq.block_table):
        block = self.blocks[block_id]
        block.ref_count = 0
        self.used_block_ids.discard(block_id)
        self.free_block_ids[block_id] = None
    seq.block_table.clear()
