import torch

from vllm_from_scratch.sampler import uniform_noise


def sample_from_probs(probs, generators=None):
    """Uses the uniform in [0, 1) as it comes: u = 0 lands on the first token even when its probability is 0."""
    cdf = probs.cumsum(dim=-1)
    u = uniform_noise(probs.shape[0], 1, probs.device, generators)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)
