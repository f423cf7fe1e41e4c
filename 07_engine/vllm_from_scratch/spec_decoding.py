"""Speculative decoding inside the engine: chapter 05's proposers, fed by the running batch, and
its rejection sampler behind one call.

Before each ``schedule()``, :class:`DraftProposer` sets every decoding request's
``spec_token_ids``; the model runner scores them with the rest of the batch and
:class:`RejectionSampler` verifies them all at once. A draft model runs batched on its own model
runner and paged KV cache (:class:`PagedDraftModel`); the engine builds that runner
(:func:`draft_model_config` says how), so this module never constructs one.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

import torch

from block_manager import BlockManager, cdiv
from chunked_prefill import BatchInputs, SchedulerInfo, build_batch_inputs
from proposers import DraftModelProposer, NgramProposer, common_prefix_len
from rejection_sampler_triton import rejection_sample_triton
from scheduler import Request
from sequence import Sequence as PagedSequence
from spec_decode import RejectionNoise, num_accepted_tokens, pad_draft_token_ids, rejection_sample
from triton_setup import HAS_TRITON
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.sampler import (
    NO_TOKEN,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_logits_processors,
    exponential_noise,
    resolve_infinite_logits,
)


class RejectionSampler:
    """Chapter 05's rejection sampling of a whole batch, behind one call (vLLM V1's
    ``RejectionSampler``): the Triton kernel on CUDA, the torch version (same noise, same tokens)
    elsewhere.

    ``vocab_size`` is the model's: a request that emits an id outside it, or has a row with no
    token to draw, gets ``[NO_TOKEN]``.
    """

    def __init__(self, device: torch.device, vocab_size: int):
        self.device = device
        self.vocab_size = vocab_size
        self.rejection_sampler = rejection_sample_triton if device.type == "cuda" and HAS_TRITON else rejection_sample

    def sample(
        self, logits: torch.Tensor, sampling_metadata: SamplingMetadata, draft_token_ids: list[list[int]]
    ) -> SamplerOutput:
        """The tokens of every sampling request: ``draft_token_ids[i]`` are request ``i``'s
        ``k_i`` drafts, whose ``k_i + 1`` rows of ``logits`` it owns (a request without drafts
        is a plain sample from its one row).

        A speculating engine samples every step here, drafts or none, so that a seeded request's
        generator is consumed the same way whether or not the rest of its batch drafted.
        """
        logits = apply_logits_processors(logits, sampling_metadata)
        logits, has_token = resolve_infinite_logits(logits)
        drawable = [bool(rows.all()) for rows in has_token.split([len(d) + 1 for d in draft_token_ids])]
        verified = self.verify_drafts(logits, sampling_metadata, draft_token_ids)
        return SamplerOutput(
            {
                rid: tokens if ok and all(0 <= t < self.vocab_size for t in tokens) else [NO_TOKEN]
                for (rid, tokens), ok in zip(verified.items(), drawable)
            }
        )

    def verify_drafts(
        self, logits: torch.Tensor, sampling_metadata: SamplingMetadata, draft_token_ids: list[list[int]]
    ) -> dict[str, list[int]]:
        """Chapter 05's rejection sampling of every sampling request's drafts, in one call.

        Request ``i``'s ``k_i + 1`` logits rows become its target distributions ``[k_i + 1, V]``,
        padded to the batch's largest ``K + 1`` (padding rows are never read); a request without
        drafts is then a plain sample from its one distribution.
        """
        metadata = sampling_metadata
        num_spec = torch.tensor([len(d) for d in draft_token_ids], device=logits.device)
        K = int(num_spec.max())
        probs = Sampler.compute_probs(logits, metadata.temperatures, metadata.top_ks, metadata.top_ps)
        starts = torch.cumsum(num_spec + 1, 0) - (num_spec + 1)
        rows = starts.unsqueeze(1) + torch.minimum(
            torch.arange(K + 1, device=logits.device).unsqueeze(0), num_spec.unsqueeze(1)
        )
        target = probs[rows]  # [B, K + 1, V]
        draft_ids = pad_draft_token_ids(draft_token_ids, K, device=logits.device)
        noise = self.rejection_noise(
            [len(d) for d in draft_token_ids], K, target.shape[-1], metadata.request_generators
        )
        out = self.rejection_sampler(draft_ids, None, target, noise=noise)
        accepted = num_accepted_tokens(out).tolist()
        return {rid: row[: n + 1] for rid, row, n in zip(metadata.request_ids, out.tolist(), accepted)}

    def rejection_noise(
        self, num_spec: list[int], K: int, vocab_size: int, generators: list[torch.Generator | None]
    ) -> RejectionNoise:
        """The rejection sampler's noise for the whole batch: a seeded request ``i`` draws its
        exponential row and then its ``num_spec[i]`` uniforms from its own generator (never the
        batch's padded ``K``), so its tokens do not depend on the batch; the rest come from one
        batched draw each."""
        uniform = torch.rand(len(num_spec), K, device=self.device)
        exponential = exponential_noise(len(num_spec), vocab_size, self.device, generators)
        for i, (gen, k) in enumerate(zip(generators, num_spec)):
            if gen is not None and k:
                uniform[i, :k].uniform_(generator=gen)
        return RejectionNoise(uniform, exponential)


class DraftRunner(Protocol):
    """What :class:`PagedDraftModel` uses of a model runner (the engine's ``ModelRunner``)."""

    config: EngineConfig
    block_size: int
    device: torch.device
    num_kvcache_blocks: int

    def compute_logits(self, batch: BatchInputs) -> torch.Tensor | None: ...


def draft_model_config(config: EngineConfig, num_target_blocks: int) -> EngineConfig:
    """The settings of a draft model's runner: the target's device, dtype, block size and
    lengths, eager, without prefix caching, with as many KV blocks as the target's
    (``num_target_blocks``) plus room for every request's drafts."""
    spec = config.speculative
    assert spec is not None and spec.model is not None, "SpeculativeConfig requires a model for draft_model"
    per_request = cdiv(spec.num_speculative_tokens + 1, config.kvcache_block_size) + 1
    draft_config = EngineConfig(
        spec.model,
        device=str(config.torch_device),
        dtype=str(config.torch_dtype).removeprefix("torch."),
        kvcache_block_size=config.kvcache_block_size,
        max_num_seqs=config.max_num_seqs,
        num_kvcache_blocks=num_target_blocks + config.max_num_seqs * per_request,
        max_model_len=config.max_model_len,
        enable_prefix_caching=False,
        enforce_eager=True,
        attention_backend=config.attention_backend,
    )
    if draft_config.vocab_size != config.vocab_size:
        raise ValueError(
            f"the draft model's vocab_size ({draft_config.vocab_size}) differs from the target's ({config.vocab_size})"
        )
    return draft_config


class PagedDraftModel:
    """A draft model (``runner``, whose KV cache it uses) answering many contexts with one forward.

    Each key (a request id) owns a chapter 01 :class:`Sequence` of the tokens the draft has K/V
    for. A call rolls each back to what it shares with the new context, feeds the rest, and returns
    the last position's logits of every row. When blocks run out, the sequences of keys not in the
    call are dropped first (they recompute their K/V when they come back).
    """

    def __init__(self, runner: DraftRunner):
        self.runner = runner
        self.block_size = runner.block_size
        self.vocab_size = runner.config.vocab_size
        self.block_manager = BlockManager(runner.num_kvcache_blocks, self.block_size)
        self.sequences: dict[Hashable, PagedSequence] = {}

    def get_logits_batch(self, token_ids_list: Sequence[Sequence[int]], keys: Sequence[Hashable]) -> torch.Tensor:
        seqs = [self._take(key, ids, batch_keys=keys) for ids, key in zip(token_ids_list, keys)]
        info = SchedulerInfo.from_sequences(seqs, [s.num_tokens - s.num_computed_tokens for s in seqs])
        logits = self.runner.compute_logits(build_batch_inputs(info, self.block_size, self.runner.device))
        assert logits is not None, "a draft model runs on one rank, which always gets the logits"
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
        return logits

    def release(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            seq = self.sequences.pop(key, None)
            if seq is not None:
                self.block_manager.free(seq)

    def _take(self, key: Hashable, ids: Sequence[int], batch_keys: Sequence[Hashable]) -> PagedSequence:
        """The key's sequence, rolled back to what it shares with ``ids`` (its
        ``num_computed_tokens``), extended to ``ids``, with slots for the new tokens."""
        seq = self.sequences.get(key)
        if seq is None:
            seq = self.sequences[key] = PagedSequence(ids, self.block_size)
        # The last token is always fed: its logits are the answer.
        start = min(common_prefix_len(seq.token_ids[: seq.num_computed_tokens], ids), len(ids) - 1)
        del seq.token_ids[start:]
        seq.token_ids.extend(ids[start:])
        seq.num_computed_tokens = start
        while not self.block_manager.allocate_slots(seq, seq.num_tokens - start):
            idle = [k for k in self.sequences if k not in batch_keys]
            if not idle:
                raise RuntimeError("the draft model's KV cache cannot hold this batch")
            self.release(idle[:1])
        return seq


class DraftProposer:
    """Sets ``spec_token_ids`` on the requests about to decode, from chapter 05's proposers.

    Args:
        config: the engine's settings; ``config.speculative_config`` says which proposer.
        draft_runner: with ``method="draft_model"``, the draft model's runner, built by the
            engine from :func:`draft_model_config`; None for n-gram drafts.
    """

    def __init__(self, config: EngineConfig, draft_runner: DraftRunner | None = None):
        spec = config.speculative
        if spec is None:
            raise ValueError("DraftProposer needs an engine config with a speculative_config")
        self.k = spec.num_speculative_tokens
        self.proposer: NgramProposer | DraftModelProposer
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            if draft_runner is None:
                raise ValueError("draft_runner is required with speculative method 'draft_model'")
            self.proposer = DraftModelProposer(PagedDraftModel(draft_runner))

    def propose(self, running: Sequence[Request]) -> None:
        """Drafts for every running request whose next step is a decode."""
        decoding = [r for r in running if r.is_decoding]
        if not decoding:
            return
        contexts = [r.token_ids for r in decoding]
        drafts: list[list[int]]
        if isinstance(self.proposer, NgramProposer):
            drafts = self.proposer.propose(contexts, self.k)
        else:
            drafts, _ = self.proposer.propose(contexts, self.k, keys=[r.request_id for r in decoding])
        for req, row in zip(decoding, drafts):
            req.spec_token_ids = row

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget the draft model's state of requests that ended."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.release(list(request_ids))
