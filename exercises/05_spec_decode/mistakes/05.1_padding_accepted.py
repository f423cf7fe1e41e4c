import torch

from spec_decode import PLACEHOLDER_TOKEN_ID, sample_rejection_noise, validate_rejection_inputs


def rejection_sample(draft_token_ids, draft_probs, target_probs, generator=None, *, noise=None):
    """Tests the -1 padding of a shorter draft row like a real draft: read as token 0, it is accepted when q(0) is 0."""
    num_draft, draft_probs = validate_rejection_inputs(draft_token_ids, draft_probs, target_probs)
    B, K = draft_token_ids.shape
    V = target_probs.shape[2]
    p_all, q_all = target_probs.float(), draft_probs.float()
    if noise is None:
        noise = sample_rejection_noise(B, K, V, target_probs.device, generator)
    ids = draft_token_ids.clamp(min=0).unsqueeze(-1)
    p = p_all[:, :K].gather(-1, ids).squeeze(-1)
    q = q_all.gather(-1, ids).squeeze(-1)
    num_accepted = (noise.uniform * q < p).long().cumprod(1).sum(1)
    rows = torch.arange(B)
    rejected = num_accepted < K
    p_last = p_all[rows, num_accepted]
    q_last = q_all[rows, num_accepted.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_last)
    residual = torch.clamp(p_last - q_last, min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
    weights = torch.where(rejected.unsqueeze(-1), residual, p_last)
    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    keep = torch.arange(K + 1).unsqueeze(0) < num_accepted.unsqueeze(1)
    out[:, :K] = torch.where(keep[:, :K], draft_token_ids.clamp(min=0), out[:, :K])
    out[rows, num_accepted] = (weights / noise.exponential).argmax(-1)
    return out
