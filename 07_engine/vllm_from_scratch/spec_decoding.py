"""Speculative decoding inside the engine, from chapter 05's parts.

Before each ``schedule()`` every decoding request gets up to ``k`` draft tokens in
``request.spec_token_ids`` (chapter 05's ``NgramProposer``, or a small draft model through
``draft_generate``). The scheduler (chapter 04) gives the request ``1 + drafts`` tokens; the
model runner computes the target's logits at all those positions in the same forward as the
rest of the batch; :func:`spec_decode.rejection_sample` keeps the drafts the target agrees with
and adds one recovered or bonus token. Every request of the step goes through the same call
(one with no drafts is a plain sample), so the output follows the target distribution exactly,
and greedy output is unchanged.

Drafts are deterministic functions of the context here (n-gram lookup, or the draft model at
temperature 0), so their distribution ``q`` is one-hot and ``draft_probs=None``.
"""

from __future__ import annotations

import torch

from proposers import HFCausalLM, NgramProposer
from spec_decode import PLACEHOLDER_TOKEN_ID, draft_generate, rejection_sample
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.model_runner import ModelRunner
from vllm_from_scratch.sampler import Sampler

METHODS = ("ngram", "draft_model")


class SpecDecoder:
    """Proposes drafts for running requests and verifies them after the forward.

    ``speculative_config`` keys: ``method`` ("ngram" or "draft_model"),
    ``num_speculative_tokens`` (k >= 1), ``model`` (draft checkpoint directory, draft_model only),
    ``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram sizes, ngram only).
    """

    def __init__(self, config: EngineConfig):
        sc = dict(config.speculative_config)
        method = sc.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
        self.k = sc.pop("num_speculative_tokens", None)
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an int >= 1, got {self.k!r}")
        self.method = method
        if method == "ngram":
            self.proposer = NgramProposer(sc.pop("prompt_lookup_min", 1), sc.pop("prompt_lookup_max", 4))
        else:
            model = sc.pop("model", None)
            if model is None:
                raise ValueError("speculative_config['model'] (a draft checkpoint directory) is required for draft_model")
            self.draft = HFCausalLM(str(model), "cpu" if config.torch_device.type == "cpu" else config.torch_device)
            if self.draft.vocab_size != config.vocab_size:
                raise ValueError(f"the draft model's vocab_size ({self.draft.vocab_size}) differs from the target's "
                                 f"({config.vocab_size})")
            self._slots: dict[str, int] = {}
            self._free_slots: list[int] = []
        if sc:
            raise ValueError(f"speculative_config has unknown keys {sorted(sc)}")
        self.vocab_size = config.vocab_size
        self.num_drafts = 0
        self.num_accepted = 0

    # ------------------------------------------------------------------ drafting
    def _slot(self, request_id: str) -> int:
        """A draft-model KV cache slot per live request, reused after the request ends."""
        if request_id not in self._slots:
            self._slots[request_id] = self._free_slots.pop() if self._free_slots else len(self._slots)
        return self._slots[request_id]

    def _release_finished(self, live_ids: set[str]) -> None:
        for rid in [r for r in self._slots if r not in live_ids]:
            self._free_slots.append(self._slots.pop(rid))

    def propose(self, running: list) -> None:
        """Set ``spec_token_ids`` on every request that decodes next step."""
        decoding = [r for r in running
                    if r.num_computed_tokens == r.num_tokens - 1 and r.num_computed_tokens >= r.num_prompt_tokens]
        if self.method == "ngram":
            for req, drafts in zip(decoding, self.proposer.propose([r.token_ids for r in decoding], self.k)):
                req.spec_token_ids = drafts
            return
        self._release_finished({r.request_id for r in running})
        for req in decoding:
            req.spec_token_ids, _ = draft_generate(self.draft.slot(self._slot(req.request_id)), req.token_ids, self.k)

    # ------------------------------------------------------------------ verification
    def execute(self, executor, requests: list, num_scheduled_tokens: list[int]) -> dict[str, list[int]]:
        """Forward the batch, then accept/reject every sampling request's drafts in one call."""
        logits, rows = executor.call("compute_logits", requests, num_scheduled_tokens)
        out = {r.request_id: [] for r in requests}
        if logits is None or logits.shape[0] == 0:
            return out
        sampling = [(r, k) for r, k in zip(requests, rows) if k]
        params = ModelRunner.sampling_tensors(requests, rows, self.vocab_size, logits.device)
        probs = Sampler.compute_probs(logits, params["temperatures"], params["top_ks"], params["top_ps"])
        K = max(k for _, k in sampling) - 1
        B, V = len(sampling), probs.shape[-1]
        draft_ids = torch.full((B, K), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        target = torch.empty(B, K + 1, V, device=probs.device)
        offset = 0
        for i, (req, k) in enumerate(sampling):
            draft_ids[i, : k - 1] = torch.tensor(req.spec_token_ids[: k - 1], dtype=torch.long)
            target[i, :k] = probs[offset:offset + k]
            target[i, k:] = probs[offset + k - 1]  # padding rows: any distribution, never read
            offset += k
        result = rejection_sample(draft_ids.to(probs.device), None, target)
        seeded = [i for i, (req, _) in enumerate(sampling) if req.generator is not None]
        for i in seeded:  # a seeded request draws from its own generator, whatever the batch
            result[i] = rejection_sample(draft_ids[i:i + 1].to(probs.device), None, target[i:i + 1],
                                         generator=sampling[i][0].generator)[0]
        for (req, k), tokens in zip(sampling, result.tolist()):
            out[req.request_id] = [t for t in tokens if t != PLACEHOLDER_TOKEN_ID]
            self.num_drafts += k - 1
            self.num_accepted += len(out[req.request_id]) - 1
        return out
