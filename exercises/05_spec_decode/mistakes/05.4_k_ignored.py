import numpy as np


def propose_one(self, token_ids, k):
    """Proposes everything that followed the match, up to the end of the context, instead of at most k tokens."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    ids = np.asarray(token_ids, dtype=np.int64)
    L = ids.size
    for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)
        hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
        if hits.size:
            return ids[int(hits[-1]) + n :].tolist() if k else []
    return []
