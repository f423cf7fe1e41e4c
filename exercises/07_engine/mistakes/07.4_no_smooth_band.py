import math

import torch


def _llama3_inv_freq(inv_freq, scaling):
    """Switches from scaled to unscaled at one wavelength, with no smooth band between the two cut-offs."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    return scaled
