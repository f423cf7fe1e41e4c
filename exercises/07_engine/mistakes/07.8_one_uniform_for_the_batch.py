import torch


def sample_from_probs(probs, generators=None):
    """Gives every row the same uniform: rows of one distribution all take the same token."""
    cdf = probs.cumsum(dim=-1)
    u = 1.0 - torch.rand(()).item()
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)
