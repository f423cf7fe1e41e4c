"""Tokens out, text in: what the engine's steps produced, as the ``RequestOutput``s callers read.

The engine core deals in token ids only; :class:`OutputProcessor` (vLLM V1's
``vllm/v1/engine/output_processor.py``) keeps one :class:`RequestState` per live request and turns
each step's :class:`scheduler.EngineCoreOutput` records into text:

* incremental detokenizing (:class:`IncrementalDetokenizer`): text is released only once it no
  longer ends in half a UTF-8 character;
* stop strings: searched in the decoded text, cut from it, held back while streaming (the last
  ``len(longest stop) - 1`` characters wait) so a client never sees part of one; a request they
  end is handed back to the core to stop (:attr:`OutputProcessorOutput.reqs_to_stop`);
* logprobs: the model runner's :class:`sampler.LogprobsLists` as vLLM's ``{token_id: Logprob}``
  dicts, each token decoded once;
* finishing: the finish reason and ``stop_reason``, ``n`` completions folded into their
  parent's record (``parallel_sampling.py``), each record shaped by its ``output_kind``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from scheduler import EngineCoreOutput, RequestStatus
from vllm_from_scratch.input_processor import EngineCoreRequest
from vllm_from_scratch.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_from_scratch.parallel_sampling import ParentRequest
from vllm_from_scratch.sampler import LogprobsLists
from vllm_from_scratch.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm_from_scratch.model_runner import ModelRunnerOutput

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


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


class LogprobsProcessor:
    """The runner's :class:`LogprobsLists` as vLLM's ``{token_id: Logprob}`` per position: the
    scored token first, then the top tokens (a scored token among them appears once)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # each token decoded alone (at most the vocabulary)

    def dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        decode = self.decode_token
        return [
            {t: Logprob(lp, rank, decode(t)) for t, lp, rank in zip(ids, lps, ranks)}
            for ids, lps, ranks in zip(lists.token_ids, lists.logprobs, lists.ranks)
        ]

    def decode_token(self, token_id: int) -> str | None:
        """A token decoded alone, as vLLM's ``convert_ids_list_to_tokens`` does; remembered, as
        a prompt's logprobs name up to 21 tokens per position (86,000 decodes for 4,096 tokens,
        about a second of the engine thread, which every other client waits for)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text


class RequestState:
    """What the output processor knows of one (child) request between its steps."""

    def __init__(
        self,
        request: EngineCoreRequest,
        tokenizer: PreTrainedTokenizerBase | None,
        parent: ParentRequest | None,
        index: int,
    ):
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent = parent
        self.index = index
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        self.all_token_ids = list(request.prompt_token_ids)  # the detokenizer reads prompt + output
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.text = ""  # the decoded output, cut at a stop string
        self.num_text_sent = 0  # characters released (the rest may still become a stop string)
        self.num_cached_tokens = 0
        # vLLM's logprob results, filled step by step; None: not asked.
        self.logprobs: list[dict[int, Logprob]] | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if params.prompt_logprobs is None else [None] * self.num_prompt_tokens
        )
        self.prompt_logprobs_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None

    @property
    def completion_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def cut_at_stop_string(self) -> str | None:
        """Cut ``text`` at its first stop string found (after it with
        ``include_stop_str_in_output``); returns that string (None: none)."""
        for s in self.params.stop or ():
            idx = self.text.find(s)
            if idx != -1:
                self.text = self.text[: idx + len(s) if self.params.include_stop_str_in_output else idx]
                return s
        return None

    def completion(self, new_token_ids: list[int], num_new_logprobs: int, text_end: int) -> CompletionOutput:
        """This step's :class:`CompletionOutput`, releasing text up to ``text_end``: the step's
        part (``DELTA``) or everything so far."""
        new_text = self.text[self.num_text_sent : text_end]
        self.num_text_sent = max(self.num_text_sent, text_end)
        delta = self.output_kind == RequestOutputKind.DELTA
        logprobs = self.logprobs
        if logprobs is not None:
            logprobs = logprobs[len(logprobs) - num_new_logprobs :] if delta else list(logprobs)
        return CompletionOutput(
            index=self.index,
            text=new_text if delta else self.text[: self.num_text_sent],
            token_ids=list(new_token_ids) if delta else self.completion_token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )

    def take_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprobs for this record: with ``DELTA`` only in the first one."""
        if self.output_kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return self.prompt_logprobs


@dataclass
class OutputProcessorOutput:
    """What one step's outputs became.

    ``request_outputs`` go to the caller (under the ids the caller gave). ``reqs_to_stop`` are the
    requests a stop string ended, which the core must now finish. For observers (the step trace,
    the drafter), by the core's own request ids: ``new_text``, the text each completion released,
    and ``finished``, the whole completion of each that ended.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_stop: list[str] = field(default_factory=list)
    new_text: dict[str, str] = field(default_factory=dict)
    finished: dict[str, CompletionOutput] = field(default_factory=dict)

    def extend(self, other: OutputProcessorOutput) -> None:
        self.request_outputs += other.request_outputs
        self.reqs_to_stop += other.reqs_to_stop
        self.new_text.update(other.new_text)
        self.finished.update(other.finished)


class OutputProcessor:
    """Turns the core's token records into :class:`RequestOutput`s (see the module docstring).

    Args:
        tokenizer: the engine thread's tokenizer (None: token ids only, no text).
        eos_token_ids: the model's end-of-sequence ids, to tell an EOS stop from a stop token.

    ``prompt_tokens_total`` and ``generation_tokens_total`` count, as vLLM's engine statistics
    do, each request's prompt when its first token comes and every generated token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.logprobs_processor = LogprobsProcessor(tokenizer)
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest, parent: ParentRequest | None = None, index: int = 0) -> None:
        """Follow ``request`` (completion ``index`` of ``parent`` when it is one of ``n``)."""
        self.request_states[request.request_id] = RequestState(request, self.tokenizer, parent, index)
        if parent is not None:
            self.parent_requests[parent.request_id] = parent

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is live: a request, a parent, or one of its completions."""
        return request_id in self.request_states or request_id in self.parent_requests

    def core_request_ids(self, request_id: str) -> list[str]:
        """The live core requests behind the caller's ``request_id``: a parent's unfinished
        children, in index order; the request itself; or none."""
        parent = self.parent_requests.get(request_id)
        if parent is None:
            return [request_id] if request_id in self.request_states else []
        return sorted(parent.child_requests, key=lambda rid: self.request_states[rid].index)

    # ------------------------------------------------------------------ a step
    def process_outputs(
        self, engine_core_outputs: Iterable[EngineCoreOutput], model_output: ModelRunnerOutput | None = None
    ) -> OutputProcessorOutput:
        """One step's records: ``engine_core_outputs`` (the tokens each request gained, and how
        it ended) with the logprobs of ``model_output``."""
        result = OutputProcessorOutput()
        if model_output is not None:
            self._fold_prompt_logprobs(model_output.prompt_logprobs)
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted while the forward ran
            lists = None if model_output is None else model_output.logprobs.get(out.request_id)
            self._process(state, out, lists, result)
        return result

    def end_requests(
        self, request_ids: Iterable[str], finish_reason: str, error: str | None = None
    ) -> OutputProcessorOutput:
        """The last records of requests the core ended outside a step's tokens: ``"abort"``, or
        ``"error"`` with ``error`` saying why."""
        result = OutputProcessorOutput()
        for rid in request_ids:
            state = self.request_states.get(rid)
            if state is not None:
                state.finish_reason, state.error = finish_reason, error
                self._report(state, [], 0, len(state.text), result)
        return result

    def _fold_prompt_logprobs(self, scored: dict[str, tuple[int, LogprobsLists]]) -> None:
        """Prompt positions by index: a preempted request that recomputes its prompt rewrites them."""
        for rid, (first, lists) in scored.items():
            state = self.request_states.get(rid)
            if state is not None and state.prompt_logprobs is not None:
                for j, entry in enumerate(self.logprobs_processor.dicts(lists)):
                    state.prompt_logprobs[first + j] = entry

    def _process(
        self, state: RequestState, out: EngineCoreOutput, lists: LogprobsLists | None, result: OutputProcessorOutput
    ) -> None:
        """Fold ``out`` into ``state``: tokens, logprobs, text, stop strings; report the step."""
        new_ids = out.new_token_ids
        if len(state.all_token_ids) == state.num_prompt_tokens:
            # Each child of an n > 1 request counts its prompt, as vLLM counts each child's
            # prefill; the part a child found in the prefix cache is in prefix_cache_hits.
            self.prompt_tokens_total += state.num_prompt_tokens
        self.generation_tokens_total += len(new_ids)
        state.all_token_ids += new_ids
        state.num_cached_tokens = out.num_cached_tokens
        num_new_logprobs = 0
        if lists is not None and state.logprobs is not None and state.cumulative_logprob is not None:
            state.logprobs += self.logprobs_processor.dicts(lists)
            state.cumulative_logprob += sum(row[0] for row in lists.logprobs)
            num_new_logprobs = len(lists.token_ids)
        # The scheduler has already stopped a request on EOS or a stop token: as vLLM's
        # detokenizer does, that token's text stays out unless the request asks for it.
        drop_stop_token = out.finish_reason == RequestStatus.FINISHED_STOPPED
        keep_stop = state.params.include_stop_str_in_output
        state.detokenizer.update(state.all_token_ids[:-1] if drop_stop_token and not keep_stop else state.all_token_ids)
        state.text = state.detokenizer.text
        # vLLM checks stop strings only once more than min_tokens tokens are out.
        num_completion_tokens = len(state.all_token_ids) - state.num_prompt_tokens
        check_stops = state.params.stop and num_completion_tokens > state.params.min_tokens
        stop_string = state.cut_at_stop_string() if check_stops else None
        if stop_string is not None:
            state.finish_reason, state.stop_reason = "stop", stop_string
            if not out.finished:
                result.reqs_to_stop.append(state.request_id)
        elif out.finish_reason is not None:
            state.finish_reason = FINISH_REASONS[out.finish_reason]
            state.stop_reason = self._stop_token(state, out.finish_reason)
        if state.finish_reason is not None:
            self._report(state, new_ids, num_new_logprobs, len(state.text), result)
            return
        # Hold back what could still become a stop string, so streamed text never shows one.
        hold = max((len(s) for s in state.params.stop or ()), default=1) - 1
        self._report(state, new_ids, num_new_logprobs, max(state.num_text_sent, len(state.text) - hold), result)

    def _stop_token(self, state: RequestState, status: RequestStatus) -> int | None:
        """The ``stop_token_ids`` entry that stopped the request, None for EOS or a length stop.

        The scheduler checks one merged set (EOS and stop tokens), so the last token tells which
        matched; EOS wins when it is both, as in vLLM, unless ``ignore_eos`` set it aside.
        """
        if status != RequestStatus.FINISHED_STOPPED or len(state.all_token_ids) == state.num_prompt_tokens:
            return None
        last = state.all_token_ids[-1]
        if last in self.eos_token_ids and not state.params.ignore_eos:
            return None
        return last if last in (state.params.stop_token_ids or ()) else None

    def _report(
        self,
        state: RequestState,
        new_token_ids: list[int],
        num_new_logprobs: int,
        text_end: int,
        result: OutputProcessorOutput,
    ) -> None:
        """Add ``state``'s record of this step to ``result`` (shaped by its ``output_kind``,
        folded into its parent's), and forget the request if it has ended."""
        num_text_sent = state.num_text_sent
        completion = state.completion(new_token_ids, num_new_logprobs, text_end)
        if state.num_text_sent > num_text_sent:
            result.new_text[state.request_id] = state.text[num_text_sent : state.num_text_sent]
        finished = completion.finished()
        if finished:
            del self.request_states[state.request_id]
            result.finished[state.request_id] = (
                completion
                if state.output_kind != RequestOutputKind.DELTA
                else CompletionOutput(
                    state.index, state.text, state.completion_token_ids, finish_reason=state.finish_reason
                )
            )
        elif state.output_kind == RequestOutputKind.FINAL_ONLY:
            return
        prompt_logprobs = state.take_prompt_logprobs()
        parent, request_id, num_cached_tokens = state.parent, state.request_id, state.num_cached_tokens
        if parent is not None:
            if state.index == 0:
                parent.prompt_logprobs, parent.num_cached_tokens = state.prompt_logprobs, num_cached_tokens
            outputs, finished = parent.get_outputs(state.request_id, completion)
            if finished:
                del self.parent_requests[parent.request_id]
            if not outputs:
                return
            request_id = parent.request_id
            if state.output_kind == RequestOutputKind.FINAL_ONLY:
                prompt_logprobs, num_cached_tokens = parent.prompt_logprobs, parent.num_cached_tokens
        else:
            outputs = [completion]
        result.request_outputs.append(
            RequestOutput(
                request_id=request_id,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids,
                prompt_logprobs=prompt_logprobs,
                outputs=outputs,
                finished=finished,
                num_cached_tokens=num_cached_tokens,
            )
        )
