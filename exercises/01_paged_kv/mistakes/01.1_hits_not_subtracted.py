def allocate_slots(self, seq, num_new_tokens, computed_blocks=()):
    """Counts the new blocks as if there were no prefix hits, so a request with hits takes blocks it never fills."""
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    num_new_blocks = self.num_new_blocks_needed(seq, num_new_tokens + len(computed_blocks) * self.block_size)
    idle_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
    if num_new_blocks + idle_hits > self.get_num_free_blocks():
        return False
    for block_id in computed_blocks:
        self._touch_block(self.blocks[block_id])
        seq.block_table.append(block_id)
    for _ in range(num_new_blocks):
        seq.block_table.append(self._allocate_block().block_id)
    return True
