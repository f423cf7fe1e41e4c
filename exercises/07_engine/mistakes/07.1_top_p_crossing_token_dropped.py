import torch


def apply_top_k_top_p(logits, top_ks, top_ps):
    """Keeps tokens while the running sum including them stays below top_p, dropping the token that reaches it."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        mask |= torch.arange(vocab).unsqueeze(0) >= top_ks.unsqueeze(1)
    if top_ps is not None:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        mask |= probs.cumsum(dim=-1) >= top_ps.unsqueeze(1)
    mask[:, 0] = False
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits.masked_fill(mask, float("-inf")))
