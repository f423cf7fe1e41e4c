import torch

from spec_decode import PLACEHOLDER_TOKEN_ID, sample_rejection_noise, validate_rejection_inputs


def rejection_sample(draft_token_ids, draft_probs, target_probs, generator=None, *, noise=None):
    """Accepts while u * q(x) < p(x), then max(p - q, 0) (p if empty) or the bonus p[K], by argmax(w / E); -1 after."""
    num_draft, draft_probs = validate_rejection_inputs(draft_token_ids, draft_probs, target_probs)
    B, K = draft_token_ids.shape
    V = target_probs.shape[2]
    if noise is None:
        noise = sample_rejection_noise(B, K, V, target_probs.device, generator)
    p, q = target_probs.float(), draft_probs.float()
    positions = torch.arange(K)
    ids = draft_token_ids.clamp(min=0).unsqueeze(-1)
    p_x, q_x = p[:, :K].gather(2, ids).squeeze(-1), q.gather(2, ids).squeeze(-1)
    accepted = (noise.uniform * q_x < p_x) & (positions < num_draft[:, None])
    num_accepted = accepted.long().cumprod(1).sum(1)  # accept while the rule holds
    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    out[:, :K] = torch.where(positions < num_accepted[:, None], draft_token_ids, out[:, :K])
    rows = torch.arange(B)
    p_j = p[rows, num_accepted]
    q_j = q[rows, num_accepted.clamp(max=K - 1)] if K else torch.zeros_like(p_j)
    residual = torch.clamp(p_j - q_j, min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_j)
    weights = torch.where((num_accepted < num_draft)[:, None], residual, p_j)
    out[rows, num_accepted] = (weights / noise.exponential).argmax(-1)
    return out
