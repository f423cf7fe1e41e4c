def forward(self, x, residual=None):
    """Normalizes x + residual but returns the old residual, so the next layer adds the wrong stream."""
    if residual is None:
        return self._norm(x)
    return self._norm(x + residual), residual
