def free(self, seq):
    """Frees the head of the table first, so a prefix chain's start is reused before its end."""
    for block_id in seq.block_table:
        self._release_block(self.blocks[block_id])
    seq.block_table.clear()
