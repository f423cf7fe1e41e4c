def forward(self, x, residual=None):
    """Adds eps after the square root, x / (sqrt(mean(x^2)) + eps): tiny activations are not normalized to 1."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)).to(x.dtype) * self.weight
    return normed if residual is None else (normed, x)
