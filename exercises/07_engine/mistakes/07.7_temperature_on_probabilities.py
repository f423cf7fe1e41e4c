import torch

from vllm_from_scratch.sampler import apply_top_k_top_p


def compute_probs(logits, temperatures, top_ks=None, top_ps=None):
    """Divides the probabilities by the temperature after the softmax, where it must divide the logits."""
    logits = logits.float()
    greedy = temperatures < 1e-5
    scaled = logits
    if top_ks is not None or top_ps is not None:
        scaled = apply_top_k_top_p(scaled, top_ks, top_ps)
    probs = scaled.softmax(dim=-1) / torch.where(greedy, torch.ones_like(temperatures), temperatures).unsqueeze(1)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs
