def allocate_slots(self, seq, num_new_tokens, computed_blocks=()):
    """Takes blocks one by one until the pool runs dry: a failed request keeps what it took."""
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    for block_id in computed_blocks:
        self._touch_block(self.blocks[block_id])
        seq.block_table.append(block_id)
    for _ in range(self.num_new_blocks_needed(seq, num_new_tokens, 0)):
        if not self.free_block_ids:
            return False
        seq.block_table.append(self._allocate_block().block_id)
    return True
