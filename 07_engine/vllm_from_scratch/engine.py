"""``LLMEngine``: the step loop that composes every chapter into a working engine.

One :meth:`LLMEngine.step`::

    drafter.propose(running)      drafts for decoding requests          chapter 05
    scheduler.schedule()          who runs, with how many tokens       chapters 04 / 06
       └─ block manager           KV blocks, prefix-cache hits         chapters 01 / 03
    executor.call("execute_model", scheduler_output)                   this chapter
       ├─ SchedulerInfo, build_batch_inputs   the flat batch            chapter 06
       ├─ store_kvcache           write the new K/V into their slots   chapter 01
       ├─ paged attention         read the cache through block tables  chapter 02
       └─ sampler / rejection     next token(s) per request            this chapter / 05
    scheduler.update_from_output() append tokens, stop tokens / max_tokens, free finished blocks
    detokenize incrementally, check stop strings → RequestOutput

The :class:`scheduler.SchedulerOutput` is the one hand-off: the model runner reads it and
nothing else, and the outputs are made from it after the update.
``add_request``/``step``/``abort_request`` are the streaming interface the OpenAI server drives;
:class:`vllm_from_scratch.llm.LLM` drives the same loop for offline batches. A request with
``SamplingParams.n`` > 1 runs as ``n`` child requests (:class:`ParentRequest`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from block_manager import BlockManager
from prefix_block_manager import PrefixCachingBlockManager
from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from sequence import Sequence
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.distributed import make_executor
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.model_runner import ModelRunner
from vllm_from_scratch.outputs import Logprob
from vllm_from_scratch.sampler import NO_TOKEN, LogprobsLists
from vllm_from_scratch.sampling_params import SamplingParams, check_int
from vllm_from_scratch.step_trace import StepTracer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm_from_scratch.kv_connector import KVConnectorScheduler
    from vllm_from_scratch.spec_decoding import DraftProposer

log = logging.getLogger(__name__)

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestOutput:
    """What one step produced for one request (streamed to clients as it comes).

    ``new_token_ids``/``new_text`` are this step's increment; ``completion_token_ids``/``text``
    everything generated so far. ``finish_reason`` is "stop" (a stop token or string), "length"
    (max_tokens or max_model_len), "abort", or "error" (the engine could not go on with the
    request: :meth:`LLMEngine.step` says when), and None while the request runs.
    ``num_cached_tokens`` are prompt tokens that were not computed (prefix-cache hits).
    ``stop_reason`` says which stop ended a "stop": the stop string or the ``stop_token_ids``
    entry that matched, or None for EOS (and while running), as vLLM's ``CompletionOutput``.
    ``logprobs`` (one dict per generated token so far: the last ``len(new_token_ids)`` are
    this step's), ``cumulative_logprob`` and ``prompt_logprobs`` are vLLM's, None unless the
    request's ``SamplingParams`` asked for them. ``index`` says which of the request's ``n``
    completions the record is about (0 when ``n`` is 1); the fields above are that completion's,
    and ``prompt_logprobs`` come with completion 0. ``error`` says why a request ended with
    finish reason "error" (None otherwise).
    """

    request_id: str
    new_token_ids: list[int]
    completion_token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    index: int = 0
    error: str | None = None


class IncrementalDetokenizer:
    """Text of the generated tokens, one step at a time, never splitting a UTF-8 character.

    A byte-level BPE token can be half of a multi-byte character, which decodes to U+FFFD
    alone; like vLLM, we decode a short window of tokens and only release text once it no
    longer ends in U+FFFD. The window starts a few prompt tokens back so that tokenizers that
    strip a leading space (SentencePiece) see the context that decides it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(len(prompt_token_ids) - 5, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""

    def update(self, all_token_ids: list[int]) -> None:
        if self.tokenizer is None:
            return
        decode = partial(self.tokenizer.decode, skip_special_tokens=self.skip_special_tokens)
        # One sequence of ids decodes to one string (the stubs also allow a batch's list).
        prefix = str(decode(all_token_ids[self.prefix_offset : self.read_offset]))
        full = str(decode(all_token_ids[self.prefix_offset :]))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(all_token_ids)


class EngineRequest(Request):
    """Chapter 04's ``Request`` plus what only the engine needs: sampling settings, a seeded
    generator, the detokenizer and how much text has been streamed. ``index`` is its completion's
    index when it is one of a :class:`ParentRequest`'s children (0 otherwise)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: list[int],
        block_size: int,
        tokenizer: PreTrainedTokenizerBase | None,
        priority: int = 0,
        device: torch.device | str = "cpu",
        index: int = 0,
        stop_token_ids: frozenset[int] | None = None,
    ):
        super().__init__(
            request_id,
            prompt_token_ids,
            max_tokens=max_tokens,
            priority=priority,
            eos_token_id=eos_token_ids,
            ignore_eos=params.ignore_eos,
            stop_token_ids=params.stop_token_ids or () if stop_token_ids is None else stop_token_ids,
            block_size=block_size,
        )
        self.sampling_params = params
        self.index = index
        self.stop_strings = list(params.stop or ())  # a list once SamplingParams is validated
        # On the device that samples: ATen refuses a CPU generator for CUDA noise.
        self.generator = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, params.skip_special_tokens)
        self.text = ""  # the decoded output, cut at a stop string
        self.num_text_sent = 0
        self.error: str | None = None  # why the engine ended it with finish reason "error"
        # vLLM's logprob results, filled step by step (engine.fold_logprobs); None: not asked.
        self.logprobs: list[dict[int, Logprob]] | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(self.prompt_token_ids)
        )

    @property
    def recomputes_prompt(self) -> bool:
        """Whether prefix-cache hits must be refused: ``prompt_logprobs`` needs the logits of
        every prompt position, which a hit would skip."""
        return self.prompt_logprobs is not None

    def __getstate__(self) -> dict:
        # Requests are pickled to tensor-parallel workers every step; they only build inputs
        # from them, so what serves sampling and text stays on rank 0: the detokenizer (it
        # holds the whole tokenizer) and the seeded generator (5 KB of state each).
        state = self.__dict__.copy()
        state["detokenizer"] = state["generator"] = None
        # So are the logprob results (workers read what to score from sampling_params).
        state["logprobs"] = state["prompt_logprobs"] = None
        return state


def child_request_id(index: int, parent_id: str) -> str:
    """The internal id of completion ``index`` of request ``parent_id`` (vLLM's spelling)."""
    return f"{index}_{parent_id}"


@dataclass
class ParentRequest:
    """A request with ``SamplingParams.n`` > 1: one child :class:`EngineRequest` per completion,
    as vLLM V1's ``ParentRequest`` (``vllm/v1/engine/parallel_sampling.py``).

    Child ``i`` is the request :func:`child_request_id` ``(i, request_id)`` with
    ``params.child_params(i)``; the scheduler runs children as independent requests, and the
    engine reports their outputs under ``request_id`` with ``index=i``. ``unfinished_ids`` are
    the children that have not reported their finished output (vLLM's ``child_requests``).

    Sharing the prompt. The children's prompts are equal, so their full prompt blocks should be
    computed once and held by all ``n`` (reference count ``n``): the fork after prefill of vLLM
    V0's sequence groups. vLLM V1 has no fork; its prefix cache registers a block's hash when it
    allocates the block, so children admitted in the same step as child 0 already hit the blocks
    child 0 is filling. Chapter 03's cache registers a block once a forward has computed it
    (``cache_full_blocks``), so children admitted beside child 0 would each compute the prompt.
    Here child 0 is queued at once and the others wait in ``parked``, outside the scheduler,
    until child 0 has computed its whole prompt (or ended); then each finds the full prompt
    blocks in the cache and computes only the rest (its last partial block; a whole last block
    when the prompt fills whole blocks, as the last token is always computed). Without prefix
    caching, or with a prompt too short to fill a block before its last token, there is nothing
    to share: every child is queued at once and computes its own prompt.
    """

    request_id: str
    children: list[EngineRequest]
    parked: list[EngineRequest] = field(default_factory=list)
    unfinished_ids: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unfinished_ids = {c.request_id for c in self.children}

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.children[0].prompt_token_ids

    @property
    def prompt_computed(self) -> bool:
        """Whether child 0 has computed its whole prompt (or ended), so its full prompt blocks
        are in the prefix cache for the parked children."""
        first = self.children[0]
        return first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: str | list[int],
    vocab_size: int,
    max_model_len: int,
    truncate_prompt_tokens: int | None = None,
) -> list[int]:
    """Token ids of ``prompt`` (text through ``tokenizer``, or ids as given), checked: not empty,
    inside the vocabulary, shorter than ``max_model_len``. :class:`ParameterError` on ``prompt``.

    ``truncate_prompt_tokens`` (``SamplingParams``'): keep the last ``k`` ids, ``-1`` the last
    ``max_model_len``, as vLLM does; more than ``max_model_len`` is an error naming it.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ParameterError("prompt", "must be a list of token ids: this checkpoint has no tokenizer")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        token_ids = list(prompt)
    else:
        raise ParameterError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    if truncate_prompt_tokens is not None:
        if truncate_prompt_tokens > max_model_len:
            raise ParameterError(
                "truncate_prompt_tokens",
                f"must be at most max_model_len ({max_model_len}), got {truncate_prompt_tokens}",
            )
        keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        token_ids = token_ids[-keep:]
    if not token_ids:
        raise ParameterError("prompt", "must not be empty")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ParameterError("prompt", f"holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(token_ids) >= max_model_len:
        raise ParameterError(
            "prompt",
            f"has {len(token_ids)} tokens, but this model's maximum context length (max_model_len) is {max_model_len}",
            code="context_length_exceeded",
        )
    return token_ids


def resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int, fit_max_tokens: bool) -> int:
    """How many tokens a request may generate: ``max_tokens``, or the context left when None.

    A ``max_tokens`` that does not fit the context is cut to it when ``fit_max_tokens`` (the
    request then ends with finish reason "length", as vLLM's offline ``LLM`` does) and refused
    otherwise (the OpenAI API's rule, which the server follows).
    """
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room and not fit_max_tokens:
        raise ParameterError(
            "max_tokens",
            f"is too large: {max_tokens}; the prompt has {num_prompt_tokens} "
            f"tokens and max_model_len is {max_model_len}",
            code="context_length_exceeded",
        )
    return min(max_tokens, room)


def _load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase | None:
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None  # tiny test checkpoints: token-id prompts only
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class EnginePrefixCachingBlockManager(PrefixCachingBlockManager):
    """Chapter 03's prefix cache, refusing hits to requests that score their prompt.

    ``prompt_logprobs`` needs the logits of every prompt position, and a hit skips computing
    them; such a request recomputes its whole prompt (its blocks still enter the cache for
    others), as vLLM V1's ``KVCacheManager.get_computed_blocks`` does.
    """

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        if getattr(seq, "recomputes_prompt", False):
            return []
        return super().get_computed_blocks(seq)


class LLMEngine:
    """The engine behind ``LLM`` and the OpenAI server.

    Takes ``LLM``'s arguments (:class:`vllm_from_scratch.config.EngineConfig`). Besides its
    methods the server reads ``tokenizer`` (Hugging Face's, or None for a checkpoint without
    one), ``max_model_len`` and ``config``.
    """

    def __init__(self, model_dir: str, **kwargs: Any):
        self.config = EngineConfig(model_dir=str(model_dir), **kwargs)
        self.max_model_len = self.config.max_model_len
        self.tokenizer = _load_tokenizer(self.config.model_dir)
        self.eos_token_ids = self._eos_token_ids()
        self._token_texts: dict[int, str] = {}  # each token decoded alone, for logprobs (at most the vocabulary)
        self.executor = make_executor(
            partial(ModelRunner, self.config), self.config.tensor_parallel_size, self.config.torch_device
        )
        num_blocks = self.executor.call("get_num_kvcache_blocks")
        self.block_manager = self._make_block_manager(num_blocks)
        self.kv_connector = self._make_kv_connector()
        self.scheduler = self._make_scheduler()
        self.drafter = self._make_drafter(num_blocks)
        self.requests: dict[str, EngineRequest] = {}  # live requests by id (children by theirs)
        self.parents: dict[str, ParentRequest] = {}  # n > 1, until every child has reported its end
        self._parent_of: dict[str, ParentRequest] = {}  # child id -> parent, until it reported its end
        self._forking: list[ParentRequest] = []  # parents with parked children
        self._pending_outputs: list[RequestOutput] = []  # reported by the next step (aborts)
        self._step_outputs: list[RequestOutput] = []  # the step in progress: its outputs so far
        self._step_requests: list[Request] = []  # ... and the requests it scheduled
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.tracer = StepTracer(self, self.config.step_trace) if self.config.step_trace else None
        self.warm_up_s = self.warm_up() if self.config.warm_up else 0.0

    # ------------------------------------------------------------------ construction
    def _eos_token_ids(self) -> list[int]:
        eos = getattr(self.config.hf_config, "eos_token_id", None)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = eos if eos is not None else self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def _make_block_manager(self, num_blocks: int) -> BlockManager:
        if self.config.enable_prefix_caching:
            return EnginePrefixCachingBlockManager(num_blocks, self.config.kvcache_block_size)
        return BlockManager(num_blocks, self.config.kvcache_block_size)

    def _make_kv_connector(self) -> KVConnectorScheduler | None:
        if self.config.kv_transfer is None:
            return None
        from vllm_from_scratch.kv_connector import KVConnectorScheduler

        assert isinstance(self.block_manager, PrefixCachingBlockManager), "the config requires prefix caching"
        # Rank 0's runner lives in this process: its pool answers the scheduler's queries.
        return KVConnectorScheduler(self.config.kv_transfer, self.block_manager, self.executor.runner.kv_worker)

    def _make_scheduler(self) -> Scheduler:
        cfg = self.config
        args: dict[str, Any] = dict(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_gpu_blocks=self.block_manager.num_blocks,
            policy=cfg.scheduling_policy,
            block_size=cfg.kvcache_block_size,
            block_manager=self.block_manager,
            kv_connector=self.kv_connector,
        )
        if not cfg.enable_chunked_prefill:
            return Scheduler(**args)
        from chunked_prefill import ChunkedPrefillScheduler

        return ChunkedPrefillScheduler(**args, long_prefill_token_threshold=cfg.long_prefill_token_threshold)

    def _make_drafter(self, num_blocks: int) -> DraftProposer | None:
        if self.config.speculative is None:
            return None
        from vllm_from_scratch.spec_decoding import DraftProposer

        return DraftProposer(self.config, num_blocks)

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        fit_max_tokens: bool = True,
    ) -> EngineRequest | ParentRequest:
        """Validate everything about a request and build it, without queueing it.

        This is the engine's one validation: it raises :class:`ParameterError` naming the
        argument. ``LLM.generate`` builds every request first, so a bad prompt anywhere in a
        batch raises before anything is scheduled. ``priority`` matters with
        ``scheduling_policy="priority"``: lower values are served first. ``fit_max_tokens``: see
        :func:`resolve_max_tokens`. With ``params.n`` > 1 it builds a :class:`ParentRequest`.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ParameterError("params", f"must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        self._check_sampling_support(params)
        check_int("priority", priority, -(2**63))
        token_ids = encode_prompt(
            self.tokenizer, prompt, self.config.vocab_size, self.max_model_len, params.truncate_prompt_tokens
        )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        child_ids = [child_request_id(i, request_id) for i in range(params.n)] if params.n > 1 else []
        for rid in (request_id, *child_ids):
            if rid in self.requests or rid in self.parents:
                runs_as = f" (its completions run as {child_ids[0]!r}...)" if rid != request_id else ""
                raise ParameterError("request_id", f"{rid!r} is already in use{runs_as}")
        max_tokens = resolve_max_tokens(params.max_tokens, len(token_ids), self.max_model_len, fit_max_tokens)
        if params.min_tokens > max_tokens:  # vLLM checks the pair once max_tokens is resolved
            raise ParameterError(
                "min_tokens",
                f"must be less than or equal to max_tokens={max_tokens} (the tokens this request may "
                f"generate), got {params.min_tokens}",
            )
        if not child_ids:
            req = self._new_request(request_id, token_ids, params, max_tokens, priority)
            self.scheduler.check_schedulable(req)  # e.g. more KV blocks than the whole cache
            return req
        # One stop set (EOS included) for every completion, however many ids the client sent.
        eos = () if params.ignore_eos else self.eos_token_ids
        stop_token_ids = frozenset(params.stop_token_ids or ()).union(eos)
        children = [
            self._new_request(rid, token_ids, params.child_params(i), max_tokens, priority, i, stop_token_ids)
            for i, rid in enumerate(child_ids)
        ]
        self.scheduler.check_schedulable(children[0])  # the children differ only in seed
        return ParentRequest(request_id, children)

    def _new_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        priority: int,
        index: int = 0,
        stop_token_ids: frozenset[int] | None = None,
    ) -> EngineRequest:
        return EngineRequest(
            request_id,
            token_ids,
            params,
            max_tokens,
            self.eos_token_ids,
            self.config.kvcache_block_size,
            self.tokenizer,
            priority,
            self.config.torch_device,
            index,
            stop_token_ids,
        )

    def _check_sampling_support(self, params: SamplingParams) -> None:
        """What :meth:`SamplingParams.validate` cannot know: the vocabulary, and which fields
        speculative decoding cannot honour (penalties and ``min_tokens`` change with each
        position, and logprobs would be needed for every accepted draft)."""
        vocab = self.config.vocab_size
        if params.n > self.config.max_n_sequences:
            raise ParameterError(
                "n", f"must be at most {self.config.max_n_sequences} (max_n_sequences), got {params.n}"
            )
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ParameterError("logit_bias", f"holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ParameterError(name, f"must be at most the vocabulary size ({vocab}), got {k}")
        banned = {t for t in params.stop_token_ids or () if t < vocab} if params.min_tokens else set()
        if params.min_tokens and not params.ignore_eos:
            banned.update(self.eos_token_ids)
        if len(banned) >= vocab:
            raise ParameterError(
                "stop_token_ids",
                f"cover the whole vocabulary, which min_tokens={params.min_tokens} bans until that many "
                "tokens are out: no token could be sampled",
            )
        if self.config.kv_transfer is not None and params.prompt_logprobs is not None:
            # Blocks loaded from the pool skip their prompt positions, as prefix-cache hits would.
            raise ParameterError("prompt_logprobs", "is not supported with a KV pool (kv_transfer_config)")
        if self.config.speculative is not None:
            for name, off in (
                ("presence_penalty", 0.0),
                ("frequency_penalty", 0.0),
                ("repetition_penalty", 1.0),
                ("min_tokens", 0),
                ("logprobs", None),
                ("prompt_logprobs", None),
            ):
                if getattr(params, name) != off:
                    raise ParameterError(name, "is not supported with speculative decoding (speculative_config)")

    def add_request(
        self,
        prompt: str | list[int] | EngineRequest | ParentRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        fit_max_tokens: bool = True,
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` (and queues nothing) on bad input.

        With ``n`` > 1 its ``n`` children are queued as :class:`ParentRequest` says: child 0 at
        once, the others once child 0's prompt is in the prefix cache.
        """
        if isinstance(prompt, (EngineRequest, ParentRequest)):
            req = prompt
        else:
            req = self.make_request(prompt, params, request_id, priority, fit_max_tokens)
        if isinstance(req, EngineRequest):
            self._queue(req)
            return req.request_id
        first, *rest = req.children
        self._queue(first)
        self.parents[req.request_id] = req
        self._parent_of.update((child.request_id, req) for child in req.children)
        bm = self.block_manager
        if isinstance(bm, PrefixCachingBlockManager) and bm.max_hit_blocks(first) > 0:
            req.parked = rest
            self._forking.append(req)
            self.requests.update((child.request_id, child) for child in rest)
        else:
            for child in rest:
                self._queue(child)
        return req.request_id

    def _queue(self, req: EngineRequest) -> None:
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; the next ``step`` reports it.

        The id of a request with ``n`` > 1 stops each of its unfinished completions, parked
        ones included; each is reported with its ``index``.
        """
        parent = self.parents.get(request_id)
        if parent is None:
            return self._abort(request_id)
        parked, parent.parked = parent.parked, []
        if parked:
            self._forking.remove(parent)
        for child in parked:
            child.status = RequestStatus.FINISHED_ABORTED  # never queued: it holds no blocks
            self._report_abort(child)
        aborted = [self._abort(child.request_id) for child in parent.children]
        return bool(parked) or any(aborted)

    def _abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or not self.scheduler.abort_request(request_id):
            return False
        self._report_abort(req)
        return True

    def _fail(self, request_id: str, why: str, outputs: list[RequestOutput]) -> None:
        """End live request ``request_id`` with finish reason "error" (its blocks go back) and
        add its last output to ``outputs``."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.is_finished:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        log.error("request %s ends with an error: %s", request_id, why)
        req.error = why
        outputs.append(self._finish(req, "error", []))

    def _report_abort(self, req: EngineRequest) -> None:
        self._pending_outputs.append(self._finish(req, "abort", []))
        if self.tracer is not None:
            self.tracer.record_abort(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or bool(self._forking)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, fold the results back; outputs of requests that advanced.

        A request whose distribution had no token to draw (``NO_TOKEN`` from the model runner)
        ends with finish reason "error" (vLLM's; the server's 500) while the others go on. An
        exception leaves this method as it came; a caller that wants to go on (the server) then
        calls :meth:`recover_from_failed_step`.
        """
        start = time.perf_counter() if self.tracer is not None else 0.0
        # What this step reports, kept where recover_from_failed_step finds it if the step raises.
        outputs = self._step_outputs = self._pending_outputs
        self._pending_outputs, self._step_requests = [], []
        self._queue_parked_children()
        if self.kv_connector is not None:
            self._load_remote_kv(self.kv_connector)
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty():
            return self._end_step()
        self._step_requests = list(sched.scheduled_requests)
        if self.kv_connector is not None:
            sched.kv_connector_metadata = self.kv_connector.build_connector_meta(sched)
        num_tokens_before = {r.request_id: r.num_tokens for r in sched.sampling_requests}
        sampled = self.executor.call("execute_model", sched)
        for rid in [rid for rid, tokens in sampled.items() if NO_TOKEN in tokens]:
            del sampled[rid]
            self._fail(rid, "no token to draw: every logit was -inf (all banned) or NaN", outputs)
        self.scheduler.update_from_output(sched, sampled)
        self._fold_logprobs(sched)
        for req in sched.sampling_requests:
            if req.request_id in self.requests:  # not aborted while the forward ran
                outputs.append(
                    self._process(self.requests[req.request_id], req.token_ids[num_tokens_before[req.request_id] :])
                )
        if self.drafter is not None:
            self.drafter.release(sched.finished_request_ids | {o.request_id for o in outputs if o.finished})
        if self.tracer is not None:
            self.tracer.on_step(sched, sampled, outputs, start, time.perf_counter() - start)
        return self._end_step()

    def _end_step(self) -> list[RequestOutput]:
        outputs, self._step_outputs, self._step_requests = self._step_outputs, [], []
        return self._parent_outputs(outputs)

    def recover_from_failed_step(self, exc: BaseException) -> list[RequestOutput]:
        """After :meth:`step` raised ``exc``: end every request that step had scheduled with
        finish reason "error" (their blocks go back) and return what the step would have
        reported, those ends included; the engine then serves the rest as before.

        A bug met by one batch costs that batch's requests, not every client's. Under tensor
        parallelism the ranks may no longer agree after a failed step, so ``exc`` is raised again.
        """
        if self.config.tensor_parallel_size > 1:
            raise exc
        outputs = self._step_outputs
        for req in self._step_requests:
            self._fail(req.request_id, f"its step failed: {exc!r}", outputs)
        return self._end_step()

    def _queue_parked_children(self) -> None:
        """Queue the parked children of each parent whose child 0 has computed its prompt."""
        forking = []
        for parent in self._forking:
            if not parent.prompt_computed:
                forking.append(parent)
                continue
            for child in parent.parked:
                self.scheduler.add_request(child)
            parent.parked = []
        self._forking = forking

    def _parent_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs as callers see them: a child's under its parent's id (its ``index``
        tells the completion). Inside the step (drafter, tracer) they keep the child's own id."""
        if not self._parent_of:
            return outputs
        public = []
        for out in outputs:
            parent = self._parent_of.get(out.request_id)
            if parent is not None:
                if out.finished:
                    del self._parent_of[out.request_id]
                    parent.unfinished_ids.discard(out.request_id)
                    if not parent.unfinished_ids:
                        del self.parents[parent.request_id]
                out = dataclasses.replace(out, request_id=parent.request_id)
            public.append(out)
        return public

    def _fold_logprobs(self, sched: SchedulerOutput) -> None:
        """Add the step's logprobs to their requests: one dict per sampled token, and prompt
        positions by index (a preempted request that recomputes its prompt rewrites them)."""
        # Rank 0 samples and lives in this process under every executor: no collective needed.
        sample, prompt = self.executor.runner.take_logprobs()
        for rid, (first, lists) in prompt.items():
            req = self.requests.get(rid)
            if req is not None and req.prompt_logprobs is not None:
                for j, entry in enumerate(self._logprob_dicts(lists)):
                    req.prompt_logprobs[first + j] = entry
        for rid, lists in sample.items():
            req = self.requests.get(rid)
            if req is None or req.logprobs is None or req.cumulative_logprob is None:
                continue
            req.logprobs.extend(self._logprob_dicts(lists))
            req.cumulative_logprob += sum(row[0] for row in lists.logprobs)

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """vLLM's ``{token_id: Logprob}`` per position: the scored token first, then the top
        tokens (a scored token among them appears once)."""
        decode = self._decode_token
        return [
            {t: Logprob(lp, rank, decode(t)) for t, lp, rank in zip(ids, lps, ranks)}
            for ids, lps, ranks in zip(lists.token_ids, lists.logprobs, lists.ranks)
        ]

    def _decode_token(self, token_id: int) -> str | None:
        """A token decoded alone, as vLLM's ``convert_ids_list_to_tokens`` does; remembered, as
        a prompt's logprobs name up to 21 tokens per position (86,000 decodes for 4,096 tokens,
        about a second of the engine thread, which every other client waits for)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def _load_remote_kv(self, connector: KVConnectorScheduler) -> None:
        """Bring in the K/V the pool promised at the last admissions, before this step's forward:
        the requests then run with whatever arrived (the rest is computed)."""
        loads = connector.take_pending_loads()
        if loads:
            self.scheduler.finish_remote_loads(self.executor.call("load_kv", loads))

    def _process(self, req: EngineRequest, new_ids: list[int]) -> RequestOutput:
        """Detokenize ``req``'s new tokens, apply its stop strings, and report the step."""
        if len(new_ids) == req.num_completion_tokens:
            # Each child of an n > 1 request counts its prompt, as vLLM counts each child's
            # prefill; the part a child found in the prefix cache is in prefix_cache_hits.
            self.prompt_tokens_total += req.num_prompt_tokens
        self.generation_tokens_total += len(new_ids)
        # The scheduler has already stopped a request on EOS or a stop token: as vLLM's
        # detokenizer does, that token's text stays out unless the request asks for it.
        drop_stop_token = req.status == RequestStatus.FINISHED_STOPPED
        keep_stop = req.sampling_params.include_stop_str_in_output
        req.detokenizer.update(req.token_ids[:-1] if drop_stop_token and not keep_stop else req.token_ids)
        req.text = req.detokenizer.text
        stop_strings = req.stop_strings
        # vLLM checks stop strings only once more than min_tokens tokens are out.
        check_stops = stop_strings and req.num_completion_tokens > req.sampling_params.min_tokens
        stop_string = self._cut_at_stop_string(req) if check_stops else None
        if stop_string is not None and not req.is_finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished:
            if stop_string is not None:
                return self._finish(req, "stop", new_ids, stop_string)
            return self._finish(req, FINISH_REASONS[req.status], new_ids, self._stop_token(req))
        # Hold back what could still become a stop string, so streamed text never shows one.
        hold = max((len(s) for s in stop_strings), default=1) - 1
        return self._output(req, new_ids, max(req.num_text_sent, len(req.text) - hold), None)

    @staticmethod
    def _cut_at_stop_string(req: EngineRequest) -> str | None:
        """Cut ``req.text`` at its first stop string found (after it with
        ``include_stop_str_in_output``); returns that string (None: none)."""
        for s in req.stop_strings:
            idx = req.text.find(s)
            if idx != -1:
                req.text = req.text[: idx + len(s) if req.sampling_params.include_stop_str_in_output else idx]
                return s
        return None

    def _stop_token(self, req: EngineRequest) -> int | None:
        """The ``stop_token_ids`` entry that stopped ``req``, None for EOS or a length stop.

        The scheduler checks one merged set (EOS and stop tokens), so the last token tells which
        matched; EOS wins when it is both, as in vLLM, unless ``ignore_eos`` set it aside.
        """
        if req.status != RequestStatus.FINISHED_STOPPED or not req.completion_token_ids:
            return None
        last = req.completion_token_ids[-1]
        if last in self.eos_token_ids and not req.sampling_params.ignore_eos:
            return None
        return last if last in (req.sampling_params.stop_token_ids or ()) else None

    def _finish(
        self, req: EngineRequest, reason: str, new_ids: list[int], stop_reason: int | str | None = None
    ) -> RequestOutput:
        del self.requests[req.request_id]
        return self._output(req, new_ids, len(req.text), reason, stop_reason)

    def _output(
        self,
        req: EngineRequest,
        new_ids: list[int],
        text_end: int,
        reason: str | None,
        stop_reason: int | str | None = None,
    ) -> RequestOutput:
        new_text = req.text[req.num_text_sent : text_end]
        req.num_text_sent = max(req.num_text_sent, text_end)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new_ids),
            completion_token_ids=req.completion_token_ids,
            new_text=new_text,
            text=req.text[: req.num_text_sent],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=stop_reason,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            cumulative_logprob=req.cumulative_logprob,
            prompt_logprobs=req.prompt_logprobs,
            index=req.index,
            error=req.error,
        )

    # ------------------------------------------------------------------ observation
    def get_stats(self) -> dict:
        """Gauges and counters for ``/metrics`` (vLLM's meanings)."""
        s = self.scheduler.get_stats()
        return {
            "num_requests_running": s["num_running"],
            "num_requests_waiting": s["num_waiting"] + sum(len(p.parked) for p in self._forking),
            "kv_cache_usage": s["kv_cache_usage"],
            "prefix_cache_queries": s.get("prefix_cache_queries", 0),
            "prefix_cache_hits": s.get("prefix_cache_hits", 0),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions_total": s["num_preemptions"],
            "spec_decode_num_draft_tokens": s["num_draft_tokens"],
            "spec_decode_num_accepted_tokens": s["num_accepted_tokens"],
            **(
                {}
                if self.kv_connector is None
                else {f"kv_pool_{k}": v for k, v in vars(self.kv_connector.stats).items()}
            ),
        }

    def warm_up(self) -> float:
        """Run the shapes the engine will meet once, before serving; returns the seconds it took.

        A prefill of each power of two up to the token budget and a decode step of each power
        of two up to ``max_num_seqs`` (at most 256): the sizes a step most often has, and the
        neighbours of the rest. ``EngineConfig.warm_up`` (on by default) runs it at construction,
        so the server's ``/health`` answers only after it.
        """
        start = time.perf_counter()
        budget = self.config.max_num_batched_tokens
        prefill = [n for n in (2**i for i in range(4, 16)) if n < budget] + [budget]
        decode = [b for b in (2**i for i in range(9)) if b <= min(self.config.max_num_seqs, 256)]
        self.executor.call("warm_up", prefill, decode)
        elapsed = time.perf_counter() - start
        log.info("warm-up: prefills of %s tokens, decode batches of %s: %.1f s", prefill, decode, elapsed)
        return elapsed

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op for one rank) and close the KV pool."""
        if self.tracer is not None:
            self.tracer.close()
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.worker.close()
