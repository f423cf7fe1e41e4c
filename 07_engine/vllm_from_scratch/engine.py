"""``LLMEngine``: the step loop that composes every chapter into a working engine.

One :meth:`LLMEngine.step`::

    (speculative decoding: propose drafts for decoding requests)        chapter 05
    scheduler.schedule()          who runs, with how many tokens       chapters 04 / 06
       └─ block manager           KV blocks, prefix-cache hits         chapters 01 / 03
    executor.call("execute_model") one forward over the mixed batch     this chapter
       ├─ store_kvcache           write the new K/V into their slots   chapter 01
       ├─ paged attention         read the cache through block tables  chapter 02
       └─ sampler / rejection     next token(s) per request            this chapter / 05
    scheduler.update_from_output() append tokens, EOS / max_tokens, free finished blocks
    detokenize incrementally, check stop strings and stop_token_ids → RequestOutput

``add_request``/``step``/``abort_request`` are the streaming interface the OpenAI server drives;
:class:`vllm_from_scratch.llm.LLM` drives the same loop for offline batches.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from functools import partial

import torch

from block_manager import BlockManager
from scheduler import Request, RequestStatus, Scheduler
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.distributed import make_executor
from vllm_from_scratch.model_runner import ModelRunner
from vllm_from_scratch.sampling_params import SamplingParams

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestOutput:
    """What one step produced for one request (streamed to clients as it comes).

    ``new_token_ids``/``new_text`` are this step's increment; ``token_ids``/``text`` everything
    generated so far. ``finish_reason`` is "stop" (EOS, stop string or stop token), "length"
    (max_tokens or max_model_len) or "abort", and None while the request runs.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


class IncrementalDetokenizer:
    """Text of the generated tokens, one step at a time, never splitting a UTF-8 character.

    A byte-level BPE token can be half of a multi-byte character, which decodes to U+FFFD
    alone; like vLLM, we decode a short window of tokens and only release text once it no
    longer ends in U+FFFD. The window starts a few prompt tokens back so that tokenizers that
    strip a leading space (SentencePiece) see the context that decides it.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.prefix_offset = max(len(prompt_token_ids) - 5, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""

    def update(self, all_token_ids: list[int]) -> None:
        if self.tokenizer is None:
            return
        decode = partial(self.tokenizer.decode, skip_special_tokens=True)
        prefix = decode(all_token_ids[self.prefix_offset:self.read_offset])
        full = decode(all_token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(all_token_ids)


class EngineRequest(Request):
    """Chapter 04's ``Request`` plus what only the engine needs: sampling settings, a seeded
    generator, the detokenizer and how much text has been streamed."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 eos_token_ids, block_size: int, tokenizer):
        super().__init__(request_id, prompt_token_ids, max_tokens=max_tokens, eos_token_id=eos_token_ids,
                         ignore_eos=params.ignore_eos, block_size=block_size)
        self.sampling_params = params
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids)
        self.num_output_tokens = 0  # tokens reported (a stop token ends the output early)
        self.text = ""  # the decoded output, cut at a stop string
        self.num_text_sent = 0
        self.stop_reason: str | None = None
        self.num_cached_prompt_tokens = 0

    def __getstate__(self) -> dict:
        # Requests are pickled to tensor-parallel workers every step; they only build inputs
        # from them, so what serves sampling and text stays on rank 0: the detokenizer (it
        # holds the whole tokenizer) and the seeded generator (5 KB of state each).
        state = self.__dict__.copy()
        state["detokenizer"] = state["generator"] = None
        return state


def _load_tokenizer(model_dir: str):
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None  # tiny test checkpoints: token-id prompts only
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class LLMEngine:
    """The engine behind ``LLM`` and the OpenAI server.

    Takes ``LLM``'s arguments (see :class:`vllm_from_scratch.config.EngineConfig`). Attributes
    the server uses: ``tokenizer`` (Hugging Face, or None for a checkpoint without one),
    ``model_config`` (the transformers config) and ``max_model_len``.
    """

    def __init__(self, model_dir: str, **kwargs):
        self.config = EngineConfig(model_dir=str(model_dir), **kwargs)
        self.model_config = self.config.hf_config
        self.max_model_len = self.config.max_model_len
        self.tokenizer = _load_tokenizer(self.config.model_dir)
        self.eos_token_ids = self._eos_token_ids()
        self.executor = make_executor(partial(ModelRunner, self.config), self.config.tensor_parallel_size,
                                      self.config.torch_device)
        num_blocks = self.executor.call("get_num_kvcache_blocks")
        self.block_manager = self._make_block_manager(num_blocks)
        self.scheduler = self._make_scheduler()
        self.spec_decoder = self._make_spec_decoder()
        self.requests: dict[str, EngineRequest] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ construction
    def _eos_token_ids(self) -> list[int]:
        eos = getattr(self.model_config, "eos_token_id", None)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = eos if eos is not None else self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def _make_block_manager(self, num_blocks: int) -> BlockManager:
        if self.config.enable_prefix_caching:
            from prefix_block_manager import PrefixCachingBlockManager

            return PrefixCachingBlockManager(num_blocks, self.config.kvcache_block_size)
        return BlockManager(num_blocks, self.config.kvcache_block_size)

    def _make_scheduler(self) -> Scheduler:
        cfg = self.config
        cls = Scheduler
        if cfg.enable_chunked_prefill:
            from chunked_prefill import ChunkedPrefillScheduler as cls
        return cls(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.block_manager.num_blocks,
                   block_size=cfg.kvcache_block_size, block_manager=self.block_manager)

    def _make_spec_decoder(self):
        if self.config.speculative_config is None:
            return None
        from vllm_from_scratch.spec_decoding import SpecDecoder

        return SpecDecoder(self.config)

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt``; ``ValueError`` naming ``prompt`` if they are unusable."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be a list of token ids: this checkpoint has no tokenizer")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, must be < max_model_len ({self.max_model_len})")
        return token_ids

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> EngineRequest:
        """Validate everything about a request and build it, without queueing it.

        ``LLM.generate`` builds every request first, so a bad prompt anywhere in a batch raises
        before anything is scheduled.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        token_ids = self.encode_prompt(prompt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Generation stops at max_model_len as in vLLM (finish reason "length").
        max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
        eos = [] if params.ignore_eos else self.eos_token_ids
        req = EngineRequest(request_id, token_ids, params, max_tokens, eos, self.config.kvcache_block_size,
                            self.tokenizer)
        self.scheduler.check_schedulable(req)  # e.g. more KV blocks than the whole cache
        return req

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` (and queues nothing) on bad input."""
        req = prompt if isinstance(prompt, EngineRequest) else self.make_request(prompt, params, request_id)
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        return req.request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; the next ``step`` reports it."""
        req = self.requests.get(request_id)
        if req is None or not self.scheduler.abort_request(request_id):
            return False
        self._pending_outputs.append(self._finish(req, "abort"))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, fold the results back; outputs of requests that advanced."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty():
            return outputs
        reqs = sched.scheduled_requests
        num_tokens = [sched.num_scheduled_tokens[r.request_id] for r in reqs]
        if self.spec_decoder is not None:
            sampled = self.spec_decoder.execute(self.executor, reqs, num_tokens)
        else:
            sampled = self.executor.call("execute_model", reqs, num_tokens)
        for req in sched.sampling_requests:
            if req.num_output_tokens == 0:  # the scheduler resets it when it frees the blocks
                req.num_cached_prompt_tokens = req.num_cached_tokens
        finished = {r.request_id: r for r in self.scheduler.update_from_output(sched, sampled)}
        for req in sched.sampling_requests:
            if req.request_id in self.requests:
                outputs.append(self._make_output(req, len(sampled[req.request_id]), finished.get(req.request_id)))
        return outputs

    def _make_output(self, req: EngineRequest, num_new: int, finished: EngineRequest | None) -> RequestOutput:
        params = req.sampling_params
        if req.num_output_tokens == 0:
            self.prompt_tokens_total += req.num_prompt_tokens
        completion = req.completion_token_ids
        start = req.num_output_tokens
        new_ids = completion[start:]
        # A stop token ends the output where it is (drafts accepted after it are dropped).
        for i, t in enumerate(new_ids):
            if t in params.stop_token_ids and not params.ignore_eos:
                new_ids = new_ids[: i + 1]
                req.stop_reason = "stop"
                break
        req.num_output_tokens += len(new_ids)
        self.generation_tokens_total += len(new_ids)
        req.detokenizer.update(req.prompt_token_ids + completion[: req.num_output_tokens])
        req.text = req.detokenizer.text
        if params.stop and self._cut_at_stop_string(req):
            req.stop_reason = "stop"
        reason = None
        if finished is not None:
            reason = FINISH_REASONS[finished.status]
        if req.stop_reason is not None:
            reason = req.stop_reason
            if finished is None:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if reason is not None:
            return self._finish(req, reason, new_ids)
        # Hold back what could still become a stop string, so streamed text never shows one.
        hold = max((len(s) for s in params.stop), default=1) - 1
        return self._output(req, new_ids, max(req.num_text_sent, len(req.text) - hold), None)

    @staticmethod
    def _cut_at_stop_string(req: EngineRequest) -> bool:
        for s in req.sampling_params.stop:
            idx = req.text.find(s)
            if idx != -1:
                req.text = req.text[:idx]
                return True
        return False

    def _finish(self, req: EngineRequest, reason: str, new_ids: list[int] | None = None) -> RequestOutput:
        del self.requests[req.request_id]
        return self._output(req, new_ids or [], len(req.text), reason)

    def _output(self, req: EngineRequest, new_ids: list[int], text_end: int, reason: str | None) -> RequestOutput:
        new_text = req.text[req.num_text_sent:text_end]
        req.num_text_sent = max(req.num_text_sent, text_end)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=list(new_ids),
            token_ids=req.completion_token_ids[: req.num_output_tokens], new_text=new_text,
            text=req.text[: req.num_text_sent], finished=reason is not None, finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_prompt_tokens)

    # ------------------------------------------------------------------ observation
    def get_stats(self) -> dict:
        """Gauges and counters for ``/metrics`` (vLLM's meanings)."""
        s = self.scheduler.get_stats()
        return {
            "num_requests_running": s["num_running"],
            "num_requests_waiting": s["num_waiting"],
            "kv_cache_usage": s["kv_cache_usage"],
            "prefix_cache_queries": s.get("prefix_cache_queries", 0),
            "prefix_cache_hits": s.get("prefix_cache_hits", 0),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions_total": s["num_preemptions"],
        }

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op for one rank)."""
        self.executor.shutdown()
