"""``LLMEngine``: the step loop that composes every chapter into a working engine.

A request comes in through the input processor (``input_processor.py``: parsed, encoded, checked,
once) as an :class:`EngineCoreRequest`; the engine deals in token ids only; its outputs go out
through the output processor (``output_processor.py``: text, stop strings, logprob dicts,
finishing) as vLLM's ``RequestOutput``. One :meth:`LLMEngine.step`::

    drafter.propose(running)      drafts for decoding requests          chapter 05
    scheduler.schedule()          who runs, with how many tokens       chapters 04 / 06
       └─ block manager           KV blocks, prefix-cache hits         chapters 01 / 03
    executor.call("execute_model", scheduler_output) → ModelRunnerOutput   this chapter
       ├─ SchedulerInfo, build_batch_inputs   the flat batch            chapter 06
       ├─ store_kvcache           write the new K/V into their slots   chapter 01
       ├─ paged attention         read the cache through block tables  chapter 02
       └─ Sampler / RejectionSampler   next token(s) per request       this chapter / 05
    scheduler.update_from_output() → EngineCoreOutput per request: the tokens it gained, its end
    output_processor.process_outputs() → RequestOutput: text, stop strings, logprobs

The :class:`scheduler.SchedulerOutput` is the one hand-off to the model runner, which reads it
and nothing else; one record comes back each way after it. ``add_request``/``step``/
``abort_request`` are the streaming interface the OpenAI server drives;
:class:`vllm_from_scratch.llm.LLM` drives the same loop for offline batches. A request with
``SamplingParams.n`` > 1 runs as ``n`` child requests (``parallel_sampling.py``). A request
with ``structured_outputs`` waits outside the scheduler until its grammar is compiled, and its
masks go to the model runner with each step (``structured_output.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from block_manager import BlockManager
from prefix_block_manager import PrefixCachingBlockManager
from scheduler import EngineCoreOutput, Request, RequestStatus, Scheduler, SchedulerOutput
from sequence import Sequence as PagedSequence
from vllm_from_scratch.config import EngineArgs, EngineConfig
from vllm_from_scratch.distributed import make_executor
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.input_processor import (
    EngineCoreRequest,
    InputProcessor,
    PromptType,
    eos_token_ids,
    load_tokenizer,
    parse_prompt,
)
from vllm_from_scratch.metrics_reader import Metric, get_metrics_snapshot
from vllm_from_scratch.model_runner import ModelRunner, ModelRunnerOutput
from vllm_from_scratch.output_processor import OutputProcessor, OutputProcessorOutput
from vllm_from_scratch.outputs import RequestOutput
from vllm_from_scratch.parallel_sampling import ParentRequest, ParkedChildren, child_request_id
from vllm_from_scratch.sampler import NO_TOKEN
from vllm_from_scratch.sampling_params import SamplingParams
from vllm_from_scratch.step_trace import StepTracer
from vllm_from_scratch.structured_output import StructuredOutputManager, StructuredOutputRequest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from vllm_from_scratch.kv_connector import KVConnectorScheduler
    from vllm_from_scratch.metrics import EngineMetrics
    from vllm_from_scratch.spec_decoding import DraftProposer

log = logging.getLogger(__name__)


class LLMEngine:
    """The engine behind ``LLM`` and the OpenAI server.

    Takes ``LLM``'s arguments (:class:`vllm_from_scratch.config.EngineConfig`). Besides its
    methods the server reads ``config``, ``max_model_len``, ``tokenizer`` (Hugging Face's, or
    None for a checkpoint without one) and ``input_processor``. Its owner may set
    ``stat_logger`` (a :class:`metrics.EngineMetrics`), which then hears of every request's
    arrival, scheduling, tokens and end, on the engine's thread.
    """

    def __init__(self, model_dir: str, **kwargs: Any):
        self.config = EngineConfig(model_dir=str(model_dir), **kwargs)
        self.max_model_len = self.config.max_model_len
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model_dir)
        self.eos_token_ids = eos_token_ids(self.config.hf_config, self.tokenizer)
        self.input_processor = InputProcessor(self.config, self.tokenizer, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.executor = make_executor(
            partial(ModelRunner, self.config), self.config.tensor_parallel_size, self.config.torch_device
        )
        num_blocks = self.executor.call("get_num_kvcache_blocks")
        self.block_manager = self._make_block_manager(num_blocks)
        self.kv_connector = self._make_kv_connector()
        self.scheduler = self._make_scheduler()
        self.drafter = self._make_drafter(num_blocks)
        self._forking: list[ParkedChildren] = []  # children waiting for their child 0's prompt
        spec = self.config.speculative
        self.structured_output = StructuredOutputManager(
            self.tokenizer,
            self.config.vocab_size,
            tuple(self.eos_token_ids),
            spec.num_speculative_tokens if spec is not None else 0,
            self.config.structured_outputs.disable_any_whitespace,
        )
        self._compiling: list[CompilingRequests] = []  # requests waiting for their grammar
        self._constrained: set[str] = set()  # live requests with a grammar: a step without any builds no mask
        self._pending = OutputProcessorOutput()  # ends since the last step (aborts), which it reports
        self._step_output = OutputProcessorOutput()  # the step in progress: what it reports so far
        self._step_requests: list[Request] = []  # ... and the requests it scheduled
        self._step_start = 0.0
        self.stat_logger: EngineMetrics | None = None
        # Speculative decoding, for vLLM's counters: steps that verified drafts for a request, and
        # the drafts accepted at each position (the scheduler counts the tokens).
        self.spec_num_drafts = 0
        self.spec_accepted_per_pos = [0] * (
            self.config.speculative.num_speculative_tokens if self.config.speculative else 0
        )
        self.tracer = StepTracer(self, self.config.step_trace) if self.config.step_trace else None
        self.warm_up_s = self.warm_up() if self.config.warm_up else 0.0

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update, output: one step for every request that runs. A request with
        no token to draw ends with finish reason "error"; an exception leaves the engine as it came
        (a caller that goes on then calls :meth:`recover_from_failed_step`)."""
        self._begin_step()  # the ends since the last step, parked children, remote K/V, drafts
        scheduler_output = self.scheduler.schedule()
        self._record_scheduled(scheduler_output)
        model_output = self._execute_model(scheduler_output)
        engine_core_outputs = self._update_from_output(scheduler_output, model_output)
        self._record_step_tokens(engine_core_outputs)
        self._process_outputs(engine_core_outputs, model_output)
        return self._end_step(scheduler_output, model_output)

    def _record_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Tell the stat logger which requests this step runs (their first step times their queue)."""
        if self.stat_logger is not None:
            now = time.monotonic()
            for req in scheduler_output.scheduled_requests:
                self.stat_logger.request_scheduled(req.request_id, req.num_preemptions, now)

    def _record_step_tokens(self, engine_core_outputs: list[EngineCoreOutput]) -> None:
        """Tell the stat logger each request's new and cached tokens of this step."""
        if self.stat_logger is not None:
            tokens = [(o.request_id, len(o.new_token_ids), o.num_cached_tokens) for o in engine_core_outputs]
            self.stat_logger.step_tokens(tokens, time.monotonic(), time.time())

    def _process_outputs(self, engine_core_outputs: list[EngineCoreOutput], model_output: ModelRunnerOutput) -> None:
        """Detokenize and check stop strings (the output processor); a stop string ends the
        request in the scheduler too."""
        processed = self.output_processor.process_outputs(engine_core_outputs, model_output)
        self._step_output.extend(processed)
        for request_id in processed.reqs_to_stop:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def _begin_step(self) -> None:
        self._step_start = time.perf_counter() if self.tracer is not None else 0.0
        self._step_output, self._pending = self._pending, OutputProcessorOutput()
        self._step_requests = []
        self._queue_parked_children()
        if self._compiling:
            self._queue_compiled()
        if self.kv_connector is not None:
            self._load_remote_kv(self.kv_connector)
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step's forward and sampling on every rank (nothing when nothing was scheduled)."""
        if scheduler_output.is_empty():
            return ModelRunnerOutput()
        self._step_requests = list(scheduler_output.scheduled_requests)
        if self.kv_connector is not None:
            scheduler_output.kv_connector_metadata = self.kv_connector.build_connector_meta(scheduler_output)
        grammar_output = self.structured_output.grammar_bitmask(scheduler_output) if self._constrained else None
        if grammar_output is None:  # no constrained request samples this step: no masks to ship
            return self.executor.call("execute_model", scheduler_output)
        return self.executor.call("execute_model", scheduler_output, grammar_output)

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """The scheduler's update; a request that had no token to draw (``NO_TOKEN``) ends with
        finish reason "error" first, and its id never joins its sequence."""
        sampled = model_output.sampled_token_ids
        undrawable = [rid for rid, tokens in sampled.items() if NO_TOKEN in tokens]
        for rid in undrawable:
            del sampled[rid]
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if drafts and rid in sampled:
                self.spec_num_drafts += 1
                for pos in range(len(sampled[rid]) - 1):
                    self.spec_accepted_per_pos[pos] += 1
        self._fail(undrawable, "no token to draw: every logit was -inf (all banned) or NaN")
        if self._constrained:
            self._accept_constrained(sampled)
        return self.scheduler.update_from_output(scheduler_output, sampled)

    def _accept_constrained(self, sampled: dict[str, list[int]]) -> None:
        """Advance each constrained request's matcher by the tokens it drew; a token its grammar
        refuses (which the mask should have made impossible) ends that request in error."""
        refused = []
        for rid in self._constrained.intersection(sampled):
            so = self.scheduler.requests[rid].structured_output  # type: ignore[attr-defined]
            if not so.accept_tokens(sampled[rid]):
                refused.append(rid)
                del sampled[rid]
        self._fail(refused, "its grammar refused a sampled token")

    def _end_step(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> list[RequestOutput]:
        output = self._step_output
        self._record_finished(output)
        if self._constrained:
            self._constrained -= scheduler_output.finished_request_ids | set(output.finished)
        if self.drafter is not None:
            self.drafter.release(scheduler_output.finished_request_ids | set(output.finished))
        if self.tracer is not None and not scheduler_output.is_empty():
            duration = time.perf_counter() - self._step_start
            self.tracer.on_step(scheduler_output, model_output.sampled_token_ids, output, self._step_start, duration)
        self._step_output, self._step_requests = OutputProcessorOutput(), []
        return output.request_outputs

    def recover_from_failed_step(self, exc: BaseException) -> list[RequestOutput]:
        """After :meth:`step` raised ``exc``: end every request that step had scheduled with
        finish reason "error" (their blocks go back) and return what the step would have
        reported, those ends included; the engine then serves the rest as before.

        A bug met by one batch costs that batch's requests, not every client's. Under tensor
        parallelism the ranks may no longer agree after a failed step, so ``exc`` is raised again.
        """
        if self.config.tensor_parallel_size > 1:
            raise exc
        self._fail([r.request_id for r in self._step_requests], f"its step failed: {exc!r}")
        output, self._step_output, self._step_requests = self._step_output, OutputProcessorOutput(), []
        self._record_finished(output)
        return output.request_outputs

    def _record_finished(self, output: OutputProcessorOutput) -> None:
        if self.stat_logger is not None:
            now = time.time()
            for rid, completion in output.finished.items():
                self.stat_logger.request_finished(rid, completion.finish_reason or "stop", now)

    def _fail(self, request_ids: Sequence[str], why: str) -> None:
        """End live requests ``request_ids`` with finish reason "error" (their blocks go back);
        the step reports their ends."""
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is not None and not req.is_finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            log.error("request %s ends with an error: %s", rid, why)
        self._step_output.extend(self.output_processor.end_requests(request_ids, "error", why))

    def _queue_compiled(self) -> None:
        """Queue the requests whose grammar is compiled; end those whose grammar failed. With
        nothing else to run, wait for the first grammar rather than spin through empty steps."""
        if not self.scheduler.has_requests() and not any(g.parked for g in self._forking):
            wait([self._compiling[0].grammar], timeout=0.1)
        compiling = []
        for group in self._compiling:
            if not group.core_requests:  # all aborted
                continue
            if not group.grammar.done():
                compiling.append(group)
            elif group.grammar.exception() is not None:
                ids = [r.request_id for _, r in group.core_requests]
                self._fail(ids, f"its grammar did not compile: {group.grammar.exception()!r}")
            else:
                self._schedule_new(group.parent, group.core_requests)
        self._compiling = compiling

    def _queue_parked_children(self) -> None:
        """Queue the parked children of each parent whose child 0 has computed its prompt."""
        forking = []
        for group in self._forking:
            if not group.prompt_computed:
                forking.append(group)
                continue
            for child in group.parked:
                self.scheduler.add_request(child)
        self._forking = forking

    def _load_remote_kv(self, connector: KVConnectorScheduler) -> None:
        """Bring in the K/V the pool promised at the last admissions, before this step's forward:
        the requests then run with whatever arrived (the rest is computed)."""
        loads = connector.take_pending_loads()
        if loads:
            loaded = self.executor.call("load_kv", loads)
            if self.stat_logger is not None:
                for rid, num_tokens in loaded.items():
                    self.stat_logger.request_loaded(rid, num_tokens)
            self.scheduler.finish_remote_loads(loaded)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | PromptType | EngineCoreRequest | None = None,
        request_id: str | SamplingParams | None = None,
        priority: int = 0,
        fit_max_tokens: bool = True,
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` (and queues nothing) on bad input.

        Two calling orders, told apart by the second argument's type:

        * the book's, ``add_request(prompt, params=None, request_id=None, ...)``: ``params`` is a
          :class:`SamplingParams` or None;
        * vLLM V1's, ``add_request(request_id, prompt, params)``: the second argument is a prompt
          (text, token ids, ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``, or a processed
          request), so the first is the id and the third the settings.

        ``prompt`` is checked by :attr:`input_processor` with ``params``, ``priority`` and
        ``fit_max_tokens`` (``InputProcessor.process_inputs``), unless it is an
        :class:`EngineCoreRequest`, a request that went through an input processor already (the
        server's, in its worker threads).
        """
        if isinstance(params, (str, list, tuple, Mapping, EngineCoreRequest)):
            # vLLM V1's order: (request_id, prompt, params).
            request_id, prompt, params = prompt, params, request_id  # type: ignore[assignment]
            if not isinstance(request_id, str):
                raise ParameterError("request_id", f"must be a string, got {type(request_id).__name__}")
        if not isinstance(prompt, EngineCoreRequest):
            # vLLM's TextPrompt / TokensPrompt dicts; text and token ids go to the checks as they are.
            text, source = parse_prompt(prompt, "prompt") if isinstance(prompt, Mapping) else (None, prompt)
            prompt = self.input_processor.process_inputs(
                request_id,  # type: ignore[arg-type]
                source,
                params,  # type: ignore[arg-type]
                priority,
                fit_max_tokens,
                prompt_text=text,
            )
        self.add_requests([prompt])
        return prompt.request_id

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        """Queue processed requests, all or none: what only the engine can check (an id already
        in use, a request bigger than the whole KV cache) is checked for every one first.

        With ``n`` > 1 a request runs as ``n`` children, queued as ``parallel_sampling.py`` says:
        child 0 at once, the others once child 0's prompt is in the prefix cache.
        """
        checked = [self._make_core_requests(request) for request in requests]
        for parent, core_requests in checked:
            self._queue(parent, core_requests)

    def _make_core_requests(
        self, request: EngineCoreRequest
    ) -> tuple[ParentRequest | None, list[tuple[EngineCoreRequest, EngineRequest]]]:
        """The scheduler's requests for ``request`` (itself, or its ``n`` children with their
        parent), checked, not yet queued."""
        params, rid = request.sampling_params, request.request_id
        child_ids = [child_request_id(i, rid) for i in range(params.n)] if params.n > 1 else []
        for taken in (rid, *child_ids):
            if self.output_processor.has_request(taken):
                runs_as = f" (its completions run as {child_ids[0]!r}...)" if taken != rid else ""
                raise ParameterError("request_id", f"{taken!r} is already in use{runs_as}")
        cfg = self.config
        parent, stop_token_ids, requests = None, None, [request]
        if child_ids:
            parent = ParentRequest(rid, params)
            requests = [
                replace(request, request_id=cid, sampling_params=cp)
                for cid, cp in map(parent.get_child_info, range(params.n))
            ]
            # One stop set (EOS included) for every completion, however many ids the client sent.
            eos = () if params.ignore_eos else self.eos_token_ids
            stop_token_ids = frozenset(params.stop_token_ids or ()).union(eos)
        core_requests = [
            (r, EngineRequest(r, self.eos_token_ids, cfg.kvcache_block_size, cfg.torch_device, stop_token_ids))
            for r in requests
        ]
        if params.structured_outputs is not None:
            for _, core in core_requests:  # one compiled grammar, a matcher per completion
                core.structured_output = self.structured_output.new_request(params.structured_outputs)
        self.scheduler.check_schedulable(core_requests[0][1])  # e.g. more KV blocks than the whole cache
        return parent, core_requests

    def _queue(
        self, parent: ParentRequest | None, core_requests: list[tuple[EngineCoreRequest, EngineRequest]]
    ) -> None:
        for index, (request, _) in enumerate(core_requests):
            self.output_processor.add_request(request, parent, index)
            if self.stat_logger is not None:
                self.stat_logger.request_added(
                    request.request_id,
                    request.arrival_time,
                    len(request.prompt_token_ids),
                    request.max_tokens,
                    parent.request_id if parent is not None else None,
                    len(core_requests),
                )
        grammar = core_requests[0][1].structured_output
        if grammar is not None:
            self._constrained.update(core.request_id for _, core in core_requests)
            if not grammar.grammar.done() or grammar.grammar.exception() is not None:  # the next step ends it
                self._compiling.append(CompilingRequests(grammar.grammar, parent, core_requests))
                return
        self._schedule_new(parent, core_requests)

    def _schedule_new(
        self, parent: ParentRequest | None, core_requests: list[tuple[EngineCoreRequest, EngineRequest]]
    ) -> None:
        """Hand new requests to the scheduler: child 0 at once, its siblings once its prompt is
        cached when it has prefix hits to share (``parallel_sampling.py``)."""
        (_, first), *rest = core_requests
        self.scheduler.add_request(first)
        bm = self.block_manager
        if parent is not None and isinstance(bm, PrefixCachingBlockManager) and bm.max_hit_blocks(first) > 0:
            self._forking.append(ParkedChildren(parent.request_id, first, [child for _, child in rest]))
            return
        for _, child in rest:
            self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; the next ``step`` reports it.

        The id of a request with ``n`` > 1 stops each of its unfinished completions, parked
        ones included; each is reported with its ``index``.
        """
        aborted = [rid for rid in self.output_processor.core_request_ids(request_id) if self._abort(rid)]
        ended = self.output_processor.end_requests(aborted, "abort")
        self._record_finished(ended)  # now: an idle engine takes no step to report them
        self._pending.extend(ended)
        return bool(aborted)

    def _abort(self, request_id: str) -> bool:
        """Stop core request ``request_id``, queued, parked or compiling; whether it was live."""
        for compiling in self._compiling:
            waiting = next((r for _, r in compiling.core_requests if r.request_id == request_id), None)
            if waiting is not None:
                compiling.core_requests = [(c, r) for c, r in compiling.core_requests if r is not waiting]
                waiting.status = RequestStatus.FINISHED_ABORTED  # never queued: it holds no blocks
                self._constrained.discard(request_id)
                self._record_abort(waiting)
                return True
        for group in self._forking:
            parked = next((r for r in group.parked if r.request_id == request_id), None)
            if parked is not None:
                group.parked.remove(parked)
                parked.status = RequestStatus.FINISHED_ABORTED  # never queued: it holds no blocks
                self._record_abort(parked)
                return True
        req = self.scheduler.requests.get(request_id)
        if req is None or not self.scheduler.abort_request(request_id):
            return False
        self._record_abort(req)
        return True

    def _record_abort(self, req: Request) -> None:
        if self.tracer is not None:
            self.tracer.record_abort(req)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix block (vLLM's): True once done, False while a request holds
        blocks, unless ``reset_running_requests`` preempts the running ones first (they are
        recomputed when they run again). ``reset_connector`` would also clear the global KV pool,
        which this engine leaves to the pool's own eviction: refused when there is one.
        """
        if reset_connector and self.kv_connector is not None:
            raise ParameterError("reset_connector", "is not supported: the global KV pool evicts on its own")
        bm = self.block_manager
        if not isinstance(bm, PrefixCachingBlockManager):
            return True  # nothing is cached
        if reset_running_requests:
            self.scheduler.preempt_running()  # chapter 04's preemption: blocks freed, recomputed later
        if not bm.reset_prefix_cache():
            log.warning("the prefix cache was not reset: %d blocks are in use", len(bm.used_block_ids))
            return False
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep mode frees the GPU's weights and KV cache for another process to use; this
        engine does not have it, and says so rather than pretend (its memory stays allocated)."""
        raise NotImplementedError(
            "sleep() is not supported by this engine: it keeps its weights and KV cache allocated "
            "(use shutdown() and a new LLM to free them)"
        )

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """See :meth:`sleep`: there is no sleep mode to wake from."""
        raise NotImplementedError("wake_up() is not supported by this engine: it has no sleep mode (see sleep())")

    def is_sleeping(self) -> bool:
        """Always False: this engine has no sleep mode (:meth:`sleep`)."""
        return False

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_requests()
            or any(group.parked for group in self._forking)
            or any(group.core_requests for group in self._compiling)
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's constructor from :class:`~vllm_from_scratch.config.EngineArgs`."""
        return cls(engine_args.model_dir, **engine_args.engine_kwargs)

    def _make_block_manager(self, num_blocks: int) -> BlockManager:
        if self.config.enable_prefix_caching:
            return EnginePrefixCachingBlockManager(num_blocks, self.config.kvcache_block_size)
        return BlockManager(num_blocks, self.config.kvcache_block_size)

    def _make_kv_connector(self) -> KVConnectorScheduler | None:
        if self.config.kv_transfer is None:
            return None
        from vllm_from_scratch.kv_connector import KVConnectorScheduler

        assert isinstance(self.block_manager, PrefixCachingBlockManager), "the config requires prefix caching"
        # Rank 0's pool answers the scheduler's queries; it lives in this process.
        return KVConnectorScheduler(
            self.config.kv_transfer,
            self.block_manager,
            partial(self.executor.call_rank0, "query_kv_pool"),
            partial(self.executor.call_rank0, "kv_connector_stats"),
        )

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
        spec = self.config.speculative
        if spec is None:
            return None
        from vllm_from_scratch.spec_decoding import DraftProposer, draft_model_config

        runner = ModelRunner(draft_model_config(self.config, num_blocks)) if spec.method == "draft_model" else None
        return DraftProposer(self.config, runner)

    # ------------------------------------------------------------------ observation
    def get_stats(self) -> dict:
        """Gauges and counters for ``/metrics`` (vLLM's meanings)."""
        s = self.scheduler.get_stats()
        # Deferred, as vLLM counts them: held back for a reason other than room in the batch (an
        # n > 1 request's completions until completion 0's prompt is cached, grammars compiling).
        num_deferred = sum(len(group.parked) for group in self._forking) + sum(
            len(group.core_requests) for group in self._compiling
        )
        return {
            "num_requests_running": s["num_running"],
            "num_requests_waiting": s["num_waiting"] + num_deferred,
            "num_requests_deferred": num_deferred,
            "kv_cache_usage": s["kv_cache_usage"],
            "prefix_cache_queries": s.get("prefix_cache_queries", 0),
            "prefix_cache_hits": s.get("prefix_cache_hits", 0),
            "prompt_tokens_total": self.output_processor.prompt_tokens_total,
            "generation_tokens_total": self.output_processor.generation_tokens_total,
            "num_preemptions_total": s["num_preemptions"],
            "spec_decode_num_drafts": self.spec_num_drafts,
            "spec_decode_num_draft_tokens": s["num_draft_tokens"],
            "spec_decode_num_accepted_tokens": s["num_accepted_tokens"],
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
            **(
                {}
                if self.kv_connector is None
                else {f"kv_pool_{k}": v for k, v in vars(self.kv_connector.stats).items()}
            ),
        }

    def attach_metrics(
        self, model_name: str, get_stats: Callable[[], dict] | None = None, registry: CollectorRegistry | None = None
    ) -> EngineMetrics:
        """Start vLLM's metrics for this engine under ``model_name`` (the served name) and return
        them: from now on the engine reports each request's life to them. ``get_stats`` is what
        scrapes read (default :meth:`get_stats`; the server passes a snapshot taken on the
        engine's thread); ``registry``, where the families go (default: their own)."""
        from vllm_from_scratch.metrics import EngineMetrics

        cfg = self.config
        self.stat_logger = EngineMetrics(
            model_name,
            self.get_stats if get_stats is None else get_stats,
            self.max_model_len,
            self.cache_config_info(),
            cfg.speculative.num_speculative_tokens if cfg.speculative is not None else None,
            registry=registry,
        )
        return self.stat_logger

    def get_metrics(self) -> list[Metric]:
        """Every ``vllm:`` series of :attr:`stat_logger` now, as vLLM's records
        (:mod:`metrics_reader`); a ``ParameterError`` when no metrics are attached."""
        if self.stat_logger is None:
            raise ParameterError(
                "disable_log_stats", "is on, so no metrics were recorded: make the LLM with disable_log_stats=False"
            )
        return get_metrics_snapshot(self.stat_logger.registry)

    def cache_config_info(self) -> dict[str, object]:
        """The labels of vLLM's ``vllm:cache_config_info`` that have a meaning here, by vLLM's
        names (its ``CacheConfig`` fields): "gpu" blocks are the engine's KV cache on any
        device, and ``cache_dtype`` "auto" means the model's dtype, the only one it keeps."""
        cfg = self.config
        num_blocks = self.block_manager.num_blocks
        return {
            "block_size": cfg.kvcache_block_size,
            "cache_dtype": "auto",
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "num_cpu_blocks": None,
            "num_gpu_blocks": num_blocks,
            "kv_cache_size_tokens": num_blocks * cfg.kvcache_block_size,
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
        if self.kv_connector is not None:
            self.executor.call_rank0("close_kv_pool")
        self.structured_output.shutdown()
        self.executor.shutdown()


class EngineRequest(Request):
    """Chapter 04's ``Request`` made from an :class:`EngineCoreRequest`, plus what the core
    needs to sample it: its settings and, when seeded, its generator. ``stop_token_ids``, when
    given, is the whole stop set (EOS included), shared by the ``n`` children of one request."""

    def __init__(
        self,
        request: EngineCoreRequest,
        eos_token_ids: Iterable[int],
        block_size: int,
        device: torch.device | str = "cpu",
        stop_token_ids: frozenset[int] | None = None,
    ):
        params = request.sampling_params
        super().__init__(
            request.request_id,
            request.prompt_token_ids,
            max_tokens=request.max_tokens,
            priority=request.priority,
            arrival_time=request.arrival_time,
            eos_token_id=list(eos_token_ids),
            ignore_eos=params.ignore_eos,
            stop_token_ids=params.stop_token_ids or () if stop_token_ids is None else stop_token_ids,
            block_size=block_size,
        )
        self.sampling_params = params
        self.structured_output: StructuredOutputRequest | None = None  # the engine's, when constrained
        # On the device that samples: ATen refuses a CPU generator for CUDA noise.
        self.generator = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None

    @property
    def recomputes_prompt(self) -> bool:
        """Whether prefix-cache hits must be refused: ``prompt_logprobs`` needs the logits of
        every prompt position, which a hit would skip."""
        return self.sampling_params.prompt_logprobs is not None

    def __getstate__(self) -> dict:
        # Requests are pickled to tensor-parallel workers every step; they only build inputs
        # from them, so the seeded generator (5 KB of state) stays on rank 0, which samples.
        state = self.__dict__.copy()
        state["generator"] = None
        state["structured_output"] = None  # the matcher, too, is rank 0's
        return state


@dataclass
class CompilingRequests:
    """The core requests of one request (its ``n`` completions, with their ``parent``) while
    ``grammar`` compiles; aborted ones leave ``core_requests``."""

    grammar: Future
    parent: ParentRequest | None
    core_requests: list[tuple[EngineCoreRequest, EngineRequest]]


class EnginePrefixCachingBlockManager(PrefixCachingBlockManager):
    """Chapter 03's prefix cache, refusing hits to requests that score their prompt.

    ``prompt_logprobs`` needs the logits of every prompt position, and a hit skips computing
    them; such a request recomputes its whole prompt (its blocks still enter the cache for
    others), as vLLM V1's ``KVCacheManager.get_computed_blocks`` does.
    """

    def get_computed_blocks(self, seq: PagedSequence) -> list[int]:
        if getattr(seq, "recomputes_prompt", False):
            return []
        return super().get_computed_blocks(seq)
