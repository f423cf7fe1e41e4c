def slot_mapping(self, seq, start, end):
    """Assumes a sequence's blocks are contiguous: slot = block_table[0] * block_size + p."""
    bs = self.block_size
    if end > len(seq.block_table) * bs:
        raise ValueError(f"positions up to {end} need more blocks than the {len(seq.block_table)} seq has")
    return [seq.block_table[0] * bs + p for p in range(start, end)]
