from vllm_from_scratch.cuda_graph import MAX_CAPTURE_SIZE


def capture_batch_sizes(max_num_seqs):
    """Steps by 16 below the maximum but leaves the maximum itself out, so a full batch finds no graph."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    max_bs = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if s < max_bs]
    return sizes
