def capture_batch_sizes(max_num_seqs):
    """Captures powers of two (1, 2, 4, 8, 16, 32, 64, ...) instead of every 16 past 8."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    maximum = min(max_num_seqs, 512)
    sizes, s = [], 1
    while s < maximum:
        sizes.append(s)
        s *= 2
    return sizes + [maximum]
