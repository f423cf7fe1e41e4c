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
    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    for b in range(B):
        j = 0
        while j < int(num_draft[b]):
            x = int(draft_token_ids[b, j])
            if not noise.uniform[b, j] * q[b, j, x] < p[b, j, x]:
                break
            out[b, j] = x
            j += 1
        if j < int(num_draft[b]):
            weights = torch.clamp(p[b, j] - q[b, j], min=0)
            if weights.sum() <= 0:
                weights = p[b, j]
        else:
            weights = p[b, j]
        out[b, j] = int((weights / noise.exponential[b]).argmax())
    return out
