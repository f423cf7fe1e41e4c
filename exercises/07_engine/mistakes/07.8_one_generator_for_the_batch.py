from vllm_from_scratch.sampler import exponential_noise


def sample_from_probs(probs, generators=None):
    """Draws the whole batch's noise from the default generator, so a seeded row depends on the batch."""
    return (probs / exponential_noise(probs.shape[0], probs.shape[1], probs.device)).argmax(dim=-1)
