def sample_from_probs(probs, generators=None):
    """Takes the most likely token of every row: a greedy pick, not a draw from the distribution."""
    return probs.argmax(dim=-1)
