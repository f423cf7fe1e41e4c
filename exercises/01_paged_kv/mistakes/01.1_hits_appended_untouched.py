def allocate_slots(self, seq, num_new_tokens, computed_blocks=()):
    """Appends prefix hits to the table without taking a reference: the block stays free to reuse."""
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    if not self.can_allocate_slots(seq, num_new_tokens, computed_blocks):
        return False
    num_new_blocks = self.num_new_blocks_needed(seq, num_new_tokens, len(computed_blocks))
    seq.block_table.extend(computed_blocks)
    for _ in range(num_new_blocks):
        seq.block_table.append(self._allocate_block().block_id)
    return True
