def capture_batch_sizes(max_num_seqs):
    """Captures up to max_num_seqs however large, one graph per 16 sequences with no cap at 512."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    max_bs = max_num_seqs
    sizes = [s for s in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if s < max_bs]
    return sizes + [max_bs]
