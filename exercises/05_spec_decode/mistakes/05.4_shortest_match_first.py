import numpy as np


def propose_one(self, token_ids, k):
    """Tries n-grams from the shortest up, so a one-token coincidence beats a long recurring phrase."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    ids = np.asarray(token_ids, dtype=np.int64)
    L = ids.size
    for n in range(self.min_n, min(self.max_n, L - 1) + 1):
        # Candidate starts i end before the suffix itself starts, so a token follows each.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)
        hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []
