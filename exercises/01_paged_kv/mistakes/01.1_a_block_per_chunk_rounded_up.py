from block_manager import cdiv


def allocate_slots(self, seq, num_new_tokens, computed_blocks=()):
    """Rounds each chunk up to whole blocks on its own, ignoring the room left in the last block."""
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    if not self.can_allocate_slots(seq, num_new_tokens, computed_blocks):
        return False
    for block_id in computed_blocks:
        self._touch_block(self.blocks[block_id])
        seq.block_table.append(block_id)
    for _ in range(cdiv(num_new_tokens, self.block_size)):
        seq.block_table.append(self._allocate_block().block_id)
    return True
