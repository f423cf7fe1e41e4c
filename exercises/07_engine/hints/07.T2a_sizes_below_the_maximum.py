def capture_batch_sizes(max_num_seqs):
    """Of 1, 2, 4, 8, 16, 32, 48, ... those below min(max_num_seqs, 512), then that maximum; else ValueError."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
    maximum = min(max_num_seqs, 512)
    candidates = [1, 2, 4, 8] + list(range(16, maximum, 16))
    return [s for s in candidates if s < maximum] + [maximum]
