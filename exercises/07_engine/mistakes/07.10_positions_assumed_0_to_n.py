def forward(self, positions, q, k):
    """Rotates token i by position i of the batch, not by its own position in its sequence."""
    cos, sin = self.cos_sin_cache[: positions.numel()].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
