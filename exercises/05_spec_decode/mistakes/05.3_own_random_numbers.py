import torch

from rejection_sampler_triton import (
    PLACEHOLDER_TOKEN_ID,
    _rejection_sample_kernel,
    sample_rejection_noise,
    validate_rejection_inputs,
)
from triton_setup import triton


def rejection_sample_triton(draft_token_ids, draft_probs, target_probs, generator=None, *, noise=None, block_v=1024):
    """Draws its own random numbers instead of the caller's generator or noise: it cannot match the torch sampler."""
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a positive power of two, got {block_v}")
    num_draft, draft_probs = validate_rejection_inputs(draft_token_ids, draft_probs, target_probs)
    B, K = draft_token_ids.shape
    V = target_probs.shape[2]
    device = target_probs.device
    noise = sample_rejection_noise(B, K, V, device, None)
    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    if B == 0:
        return out
    # A [B, 0, V] tensor has no storage to point at; give the kernel one row it never reads.
    q = draft_probs.float().contiguous() if K else torch.zeros(B, 1, V, device=device)
    _rejection_sample_kernel[(B,)](
        out,
        draft_token_ids.contiguous(),
        q,
        target_probs.float().contiguous(),
        num_draft.long().contiguous(),
        noise.uniform.float().contiguous(),
        noise.exponential.float().contiguous(),
        V,
        K=K,
        BLOCK_V=min(block_v, triton.next_power_of_2(V)),
    )
    return out
