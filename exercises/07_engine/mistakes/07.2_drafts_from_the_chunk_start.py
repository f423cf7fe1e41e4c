import torch

from spec_decode import num_accepted_tokens, pad_draft_token_ids
from vllm_from_scratch.sampler import Sampler


def verify_drafts(self, logits, sampling, info):
    """Takes a row's drafts from the start of its chunk (the last sampled token first), not its last k tokens."""
    drafts = [
        info.merge_prompt[idx : idx + k]
        for idx, last, k in zip(info.chunk_idx, info.last_pos, info.num_spec)
        if last >= 0
    ]
    num_spec = torch.tensor([len(d) for d in drafts])
    K = int(num_spec.max())
    probs = Sampler.compute_probs(logits, sampling.temperatures, sampling.top_ks, sampling.top_ps)
    starts = torch.cumsum(num_spec + 1, 0) - (num_spec + 1)
    rows = starts.unsqueeze(1) + torch.minimum(torch.arange(K + 1).unsqueeze(0), num_spec.unsqueeze(1))
    target = probs[rows]
    draft_ids = pad_draft_token_ids(drafts, K)
    noise = self.rejection_noise([len(d) for d in drafts], K, target.shape[-1], sampling.request_generators)
    out = self.rejection_sampler(draft_ids, None, target, noise=noise)
    accepted = num_accepted_tokens(out).tolist()
    return {rid: row[: n + 1] for rid, row, n in zip(sampling.request_ids, out.tolist(), accepted)}
