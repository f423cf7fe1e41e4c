def slot_mapping(self, seq, start, end):
    """slot = block_table[p // block_size] * block_size + p % block_size; ending past the table: ValueError."""
    if end > len(seq.block_table) * self.block_size:
        needed = -(-end // self.block_size)
        raise ValueError(f"positions up to {end} need {needed} blocks, the table has {len(seq.block_table)}")
    return [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
