import torch

from spec_decode import PLACEHOLDER_TOKEN_ID, sample_rejection_noise, validate_rejection_inputs


def rejection_sample(draft_token_ids, draft_probs, target_probs, generator=None, *, noise=None):
    """Accepts a draft with probability p(x), forgetting to divide by q(x): the output follows neither p nor q."""
    num_draft, draft_probs = validate_rejection_inputs(draft_token_ids, draft_probs, target_probs)
    B, K = draft_token_ids.shape
    V = target_probs.shape[2]
    p_all = target_probs.float()
    q_all = draft_probs.float()
    if noise is None:
        noise = sample_rejection_noise(B, K, V, target_probs.device, generator)

    ids = draft_token_ids.clamp(min=0).unsqueeze(-1)
    p = p_all[:, :K].gather(-1, ids).squeeze(-1)
    live = draft_token_ids >= 0
    accepted = live & (noise.uniform < p)
    # Only the prefix before the first rejection counts.
    num_accepted = accepted.long().cumprod(1).sum(1)

    rows = torch.arange(B, device=target_probs.device)
    rejected = num_accepted < num_draft
    p_last = p_all[rows, num_accepted]
    q_last = q_all[rows, num_accepted.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_last)
    residual = torch.clamp(p_last - q_last, min=0)
    # p == q up to rounding can leave no residual mass; p itself is then the right fallback.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
    weights = torch.where(rejected.unsqueeze(-1), residual, p_last)
    last_token = (weights / noise.exponential).argmax(-1)

    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=target_probs.device)
    positions = torch.arange(K + 1, device=target_probs.device).unsqueeze(0)
    keep = positions < num_accepted.unsqueeze(1)
    out[:, :K] = torch.where(keep[:, :K], draft_token_ids, out[:, :K])
    out[rows, num_accepted] = last_token
    return out
