def forward(self, positions, q, k):
    """Reads cos_sin_cache[positions] in q's dtype, splits it into cos and sin, rotates q and k with self._rotate."""
    cos, sin = self.cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, head_size]: the same angles for every head
    return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
