def forward(self, x, residual=None):
    """Normalizes x before adding the residual, and hands back the old residual."""
    if residual is None:
        return self._norm(x)
    return self._norm(x) + residual, residual
