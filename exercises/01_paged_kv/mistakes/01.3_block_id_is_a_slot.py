def slot_mapping(self, seq, start, end):
    """Forgets that a block holds block_size slots: slot = block_table[p // block_size] + p % block_size."""
    bs = self.block_size
    if end > len(seq.block_table) * bs:
        raise ValueError(f"positions up to {end} need more blocks than the {len(seq.block_table)} seq has")
    return [seq.block_table[p // bs] + p % bs for p in range(start, end)]
