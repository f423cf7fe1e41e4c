"""Speculative decoding inside the engine: chapter 05's proposers, fed by the running batch.

Before each ``schedule()``, :class:`DraftProposer` sets every decoding request's
``spec_token_ids``; the model runner scores them with the rest of the batch and verifies them
(``ModelRunner.verify_drafts``). A draft model runs batched on its own :class:`ModelRunner` and
paged KV cache (:class:`PagedDraftModel`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch

from block_manager import BlockManager, cdiv
from chunked_prefill import SchedulerInfo, build_batch_inputs
from proposers import DraftModelProposer, NgramProposer, common_prefix_len
from scheduler import Request
from sequence import Sequence as PagedSequence
from vllm_from_scratch.config import EngineConfig, SpeculativeConfig
from vllm_from_scratch.model_runner import ModelRunner


class PagedDraftModel:
    """A draft model (``runner``, whose KV cache it uses) answering many contexts with one forward.

    Each key (a request id) owns a chapter 01 :class:`Sequence` of the tokens the draft has K/V
    for. A call rolls each back to what it shares with the new context, feeds the rest, and returns
    the last position's logits of every row. When blocks run out, the sequences of keys not in the
    call are dropped first (they recompute their K/V when they come back).
    """

    def __init__(self, runner: ModelRunner):
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
        num_target_blocks: the target's KV blocks (a draft model's cache gets as many, plus
            room for every request's drafts).
    """

    def __init__(self, config: EngineConfig, num_target_blocks: int):
        spec = config.speculative
        if spec is None:
            raise ValueError("DraftProposer needs an engine config with a speculative_config")
        self.k = spec.num_speculative_tokens
        self.proposer: NgramProposer | DraftModelProposer
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.proposer = DraftModelProposer(PagedDraftModel(self._draft_runner(config, spec, num_target_blocks)))

    def _draft_runner(self, config: EngineConfig, spec: SpeculativeConfig, num_target_blocks: int) -> ModelRunner:
        assert spec.model is not None, "SpeculativeConfig requires a model for draft_model"
        per_request = cdiv(self.k + 1, config.kvcache_block_size) + 1
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
                f"the draft model's vocab_size ({draft_config.vocab_size}) differs from the "
                f"target's ({config.vocab_size})"
            )
        return ModelRunner(draft_config)

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
