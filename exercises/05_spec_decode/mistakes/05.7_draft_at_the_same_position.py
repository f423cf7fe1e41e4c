import torch

from spec_decode import PLACEHOLDER_TOKEN_ID


def rejection_sampling_batched(target_sampled, draft_tokens, cu_num_logits, num_speculative_steps):
    """Checks target_sampled[i] against draft_tokens[i], the input it was computed from, not the next one."""
    if cu_num_logits.dim() != 1 or cu_num_logits.numel() < 1:
        raise ValueError("cu_num_logits must be a 1-D tensor of num_reqs + 1 offsets")
    if target_sampled.shape != draft_tokens.shape or target_sampled.dim() != 1:
        raise ValueError("target_sampled and draft_tokens must be 1-D tensors of equal length")
    counts = cu_num_logits[1:] - cu_num_logits[:-1]
    if (counts < 1).any() or (counts > num_speculative_steps + 1).any():
        raise ValueError(f"cu_num_logits: each request needs 1..{num_speculative_steps + 1} positions")
    if int(cu_num_logits[-1]) != target_sampled.numel():
        raise ValueError("cu_num_logits[-1] must equal len(target_sampled)")
    width = num_speculative_steps + 1
    starts = cu_num_logits[:-1].long()
    offs = torch.arange(width, device=target_sampled.device)
    idx = (starts.unsqueeze(1) + offs).clamp(max=target_sampled.numel() - 1)
    in_req = offs.unsqueeze(0) < counts.unsqueeze(1)
    target = target_sampled[idx]
    # The draft that position i verifies is the next input id; the last position has none.
    has_draft = offs.unsqueeze(0) < (counts - 1).unsqueeze(1)
    draft = draft_tokens[idx]
    match = has_draft & (target == draft)
    num_sampled = match.long().cumprod(1).sum(1) + 1
    keep = in_req & (offs.unsqueeze(0) < num_sampled.unsqueeze(1))
    sampled = torch.where(keep, target, torch.full_like(target, PLACEHOLDER_TOKEN_ID))
    return sampled, num_sampled.to(torch.int32)
