import torch

from vllm_from_scratch.spec_decoding import Sampler, num_accepted_tokens, pad_draft_token_ids


def verify_drafts(self, logits, sampling_metadata, draft_token_ids):
    """Keeps only the accepted drafts, dropping the token the target samples after them."""
    sampling, drafts = sampling_metadata, draft_token_ids
    num_spec = torch.tensor([len(d) for d in drafts], device=logits.device)
    K = int(num_spec.max())
    probs = Sampler.compute_probs(logits, sampling.temperatures, sampling.top_ks, sampling.top_ps)
    starts = torch.cumsum(num_spec + 1, 0) - (num_spec + 1)
    rows = starts.unsqueeze(1) + torch.minimum(
        torch.arange(K + 1, device=logits.device).unsqueeze(0), num_spec.unsqueeze(1)
    )
    target = probs[rows]  # [B, K + 1, V]
    draft_ids = pad_draft_token_ids(drafts, K, device=logits.device)
    noise = self.rejection_noise([len(d) for d in drafts], K, target.shape[-1], sampling.request_generators)
    out = self.rejection_sampler(draft_ids, None, target, noise=noise)
    accepted = num_accepted_tokens(out).tolist()
    return {rid: row[:n] for rid, row, n in zip(sampling.request_ids, out.tolist(), accepted)}
