import torch


def apply_top_k_top_p(logits, top_ks, top_ps):
    """Masks ranks above top_k instead of from top_k on (ranks count from 0), keeping k + 1 tokens."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        mask |= torch.arange(vocab, device=logits.device).unsqueeze(0) > top_ks.unsqueeze(1)
    if top_ps is not None:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens *before* it already reach top_p.
        mask |= (probs.cumsum(dim=-1) - probs) >= top_ps.unsqueeze(1)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)
