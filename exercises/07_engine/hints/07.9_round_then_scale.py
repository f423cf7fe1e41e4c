import torch


def forward(self, x, residual=None):
    """Normalizes in float32, rounds to x's dtype, then multiplies by weight in x's dtype; residual added first."""
    if residual is not None:
        x = x + residual
    as_float = x.float()
    normed = (as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
    out = normed * self.weight.to(x.dtype)
    return out if residual is None else (out, x)
