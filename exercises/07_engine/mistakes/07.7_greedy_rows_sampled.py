import torch

from vllm_from_scratch.sampler import apply_top_k_top_p


def compute_probs(logits, temperatures, top_ks=None, top_ps=None):
    """Treats a temperature of 0 as 'no temperature': greedy rows sample from the softmax instead of the argmax."""
    logits = logits.float()
    greedy = temperatures < 1e-5
    scaled = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures).unsqueeze(1)
    if top_ks is not None or top_ps is not None:
        scaled = apply_top_k_top_p(scaled, top_ks, top_ps)
    probs = scaled.softmax(dim=-1)

    return probs
