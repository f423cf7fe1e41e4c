"""Rotary position embeddings (RoPE), as the checkpoint's config describes them.

Pairs of features ``(x[i], x[i + d/2])`` of every head are rotated by the angle
``position * inv_freq[i]`` (the "rotate half" layout of Llama and Qwen). The cosines and sines of
every position up to ``max_position`` are computed once; ``forward`` only gathers the batch's rows.

Each row of the cache holds ``[cos, cos | -sin, sin]``, so a whole head rotates at once:
``x * [cos, cos] + [x2, x1] * [-sin, sin]`` is ``[x1 cos - x2 sin, x2 cos + x1 sin]``, with
``[x2, x1]`` one ``roll`` of ``x``: four ops per tensor instead of eight, and the same bits.

The scaled variants a config's ``rope_scaling`` may name change only the frequencies (and, for
LongRoPE, the amplitude of the cosines and sines), never how a head is rotated: Llama 3.x's
``llama3`` and LongRoPE's ``longrope`` (Phi-3, MiniCPM4).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.x's frequency-dependent stretch: long wavelengths slowed by ``factor``."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _longrope(inv_freq: torch.Tensor, max_position: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE's frequencies and the factor on cos and sin (MiniCPM4, Phi-3).

    Every frequency is divided by its own searched factor: ``long_factor`` when the model's
    positions go past ``original_max_position_embeddings`` (the length it was pretrained at),
    ``short_factor`` when they stay within it. One set serves every position of a run, as in the
    checkpoint authors' code and vLLM, so K/V already in the cache never meets a query rotated by
    the other set. Stretching the context by ``s = max_position / original`` flattens attention,
    so cos and sin (and with them every q·k) are scaled by ``sqrt(1 + ln s / ln original)``
    (``short_mscale`` / ``long_mscale`` where the config gives it).
    """
    original = scaling["original_max_position_embeddings"]
    kind = "long" if max_position > original else "short"
    factors = scaling[f"{kind}_factor"]
    if len(factors) != len(inv_freq):
        raise ValueError(
            f"rope_scaling {kind}_factor must hold one factor per frequency (head_size / 2 = {len(inv_freq)}), "
            f"got {len(factors)}"
        )
    stretch = max_position / original
    mscale = math.sqrt(1 + math.log(stretch) / math.log(original)) if stretch > 1 else 1.0
    return inv_freq / torch.tensor(factors, dtype=torch.float32), float(scaling.get(f"{kind}_mscale", mscale))


class RotaryEmbedding(nn.Module):
    """Apply RoPE to q and k of shape ``[T, heads * head_size]`` (or ``[T, heads, head_size]``)."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_size: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"head_size must be even, got {head_size}")
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        scaling = rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        mscale = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "longrope":
            inv_freq, mscale = _longrope(inv_freq, max_position, scaling)
        elif rope_type != "default":
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3, longrope)")
        freqs = torch.arange(max_position, dtype=torch.float).unsqueeze(1) * inv_freq.unsqueeze(0)
        cos, sin = freqs.cos() * mscale, freqs.sin() * mscale
        # Kept in float32 whatever the model dtype: bf16 angles are wrong by whole radians at
        # large positions.
        self.register_buffer("cos_sin_cache", torch.cat([cos, cos, -sin, sin], dim=-1), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate every head of ``x`` (``[T, heads * head_size]``) by ``cos = [cos, cos]`` and
        ``sin = [-sin, sin]`` (``[T, 1, head_size]``, as ``forward`` splits the cache rows)."""
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        return (x * cos + x.roll(self.head_size // 2, dims=-1) * sin).view(shape)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


_ROPES: dict[tuple[int, int, float, str, str], RotaryEmbedding] = {}


def get_rope(
    head_size: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None
) -> RotaryEmbedding:
    """The rotary embedding for these settings on the current default device, built once and
    shared by every layer that asks (vLLM's ``get_rope`` does the same): the default model's
    30 layers would otherwise hold 30 identical 4 MB caches."""
    key = (head_size, max_position, base, repr(sorted((rope_scaling or {}).items())), str(torch.get_default_device()))
    if key not in _ROPES:
        _ROPES[key] = RotaryEmbedding(head_size, max_position, base, rope_scaling)
    return _ROPES[key]
