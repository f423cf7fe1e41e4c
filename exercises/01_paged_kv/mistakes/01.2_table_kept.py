def free(self, seq):
    """Returns the blocks but leaves the block table in place, pointing at blocks it no longer holds."""
    for block_id in reversed(seq.block_table):
        self._release_block(self.blocks[block_id])
