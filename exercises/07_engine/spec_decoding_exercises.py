"""Exercise 07.2 of 07_engine: your versions of vllm_from_scratch/spec_decoding.py.

Replace each `raise NotImplementedError(...)` with your code, then run
`pytest 07_engine/ --impl=student` (or `--exercise ID` for one exercise). The tests are
the chapter's own; see exercises/README.md for how your function is put in place.
"""

from __future__ import annotations

import torch

from scheduler import Request
from spec_decode import RejectionNoise, num_accepted_tokens, pad_draft_token_ids, rejection_sample
from vllm_from_scratch.sampler import (
    NO_TOKEN,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_logits_processors,
    exponential_noise,
    resolve_infinite_logits,
)


def verify_drafts(
    self, logits: torch.Tensor, sampling_metadata: SamplingMetadata, draft_token_ids: list[list[int]]
) -> dict[str, list[int]]:
    """Chapter 05's rejection sampling of every sampling request's drafts, in one call.

    Request ``i``'s ``k_i + 1`` logits rows become its target distributions ``[k_i + 1, V]``,
    padded to the batch's largest ``K + 1`` (padding rows are never read); a request without
    drafts is then a plain sample from its one distribution.

    Becomes ``RejectionSampler.verify_drafts`` (a method: ``self`` is the RejectionSampler).
    Call parent methods as ``Parent.method(self, ...)``, not ``super()``.

    Hint: Request i owns k_i + 1 consecutive logits rows: gather them into target [B, K+1, V]
    (index each row's start plus min(j, k_i)), pad draft_token_ids with pad_draft_token_ids,
    draw the batch's noise with self.rejection_noise (seeded requests from their own
    generators), call self.rejection_sampler once with noise= and keep num_accepted_tokens + 1
    tokens of each row.

    Checked by: pytest 07_engine/ --impl=student --exercise 07.2
    """
    raise NotImplementedError(
        "Exercise 07.2: implement RejectionSampler.verify_drafts — see 07_engine/README.md#exercises"
    )
