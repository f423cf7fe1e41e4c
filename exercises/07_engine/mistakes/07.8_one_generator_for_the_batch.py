import torch


def sample_from_probs(probs, generators=None):
    """Draws every row's uniform from the default generator, so a seeded row depends on the batch."""
    cdf = probs.cumsum(dim=-1)
    u = 1.0 - torch.rand(probs.shape[0], 1, device=probs.device)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)
