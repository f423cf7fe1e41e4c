def forward(self, positions, q, k):
    """Rotates the queries only: q.k then no longer depends on the distance between the two tokens."""
    cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return self._rotate(q, cos, sin), k
