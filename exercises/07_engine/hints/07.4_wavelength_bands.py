import math

import torch


def _llama3_inv_freq(inv_freq, scaling):
    """Long wavelengths: frequency / factor; short: kept; between: smooth = (old / wavelength - low) / (high - low)."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling.get("low_freq_factor", 1), scaling.get("high_freq_factor", 4)
    wavelength = 2 * math.pi / inv_freq
    smooth = (old / wavelength - low) / (high - low)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > old / low, inv_freq / factor, inv_freq)
    return torch.where((wavelength >= old / high) & (wavelength <= old / low), between, out)
