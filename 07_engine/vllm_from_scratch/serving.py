"""The OpenAI endpoints' logic: a request body in, engine requests out, a response back.

The body becomes a :class:`SamplingParams` and one :class:`EngineCoreRequest` per prompt, made by
the engine's own input processor (its :class:`ParameterError` becomes a 400 naming the field) in
worker threads with a tokenizer of their own: a prompt is encoded and checked once, never on the
event loop that streams the other clients' tokens nor on the engine's thread. The engine's
logprobs come back in OpenAI's shapes (:mod:`openai_logprobs`), with completions' ``echo``
showing the prompt and its logprobs first, as vLLM's server does (lm-evaluation-harness scores a
continuation that way). A request's ``n`` completions are one engine request each prompt (the
engine runs them as child requests) and ``n`` choices each prompt in the response, laid out as
vLLM lays them out (:class:`Choices`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vllm_from_scratch.async_llm import AsyncLLM, EngineDeadError, RequestStream
from vllm_from_scratch.chat_utils import render_chat
from vllm_from_scratch.config import ServingLimits
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.input_processor import EngineCoreRequest, InputProcessor
from vllm_from_scratch.openai_logprobs import LogprobEntry, LogprobsRenderer, padded, prompt_logprobs_json
from vllm_from_scratch.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    message_dicts,
    now,
    random_id,
    usage,
)
from vllm_from_scratch.sampling_params import RequestOutputKind, SamplingParams
from vllm_from_scratch.streaming import SSE_DONE, collect_or_abort, sse, stream_events
from vllm_from_scratch.tool_calling import ToolCallExtractor

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm_from_scratch.outputs import CompletionOutput, Logprob, RequestOutput

OpenAIRequest: TypeAlias = CompletionRequest | ChatCompletionRequest
# Request bodies prepared (and whole responses rendered) at once. Two: one long body does not
# hold up every other client's request, and the bodies being tokenized together (each up to the
# size limit) stay few.
PREPARE_WORKERS = 2


@dataclass
class PromptState:
    """What the choices of one prompt share: its token ids, its text where the response echoes
    it (completions' ``echo``), and what the engine reports once for the prompt, with its
    completion 0: the prompt's logprobs and its prefix-cache hits."""

    token_ids: list[int]
    echo: str | None = None
    logprobs: list[LogprobEntry] | None = None
    cached_tokens: int = 0


@dataclass
class Choice:
    """What one choice accumulates while its completion runs, and how much of it a response sent.

    ``echo_only`` shows the echoed prompt and nothing else (``max_tokens: 0``);
    ``echo_logprobs``: the echoed prompt comes with its logprobs, so the piece that echoes it
    waits for them (:attr:`ready`).
    """

    prompt: PromptState
    echo_only: bool = False
    echo_logprobs: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    echoed: bool = False
    sent_tokens: int = 0
    sent_text: int = 0  # characters of ``text`` taken
    sent_chars: int = 0  # characters sent, the echoed prompt's included

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ready(self) -> bool:
        """Whether the next piece can be sent. Only completion 0 scores the prompt, and with
        ``n`` > 1 another completion's first tokens could come before it reports the scores."""
        return not self.echo_logprobs or self.echoed or self.prompt.logprobs is not None

    def update(self, out: RequestOutput, completion: CompletionOutput) -> None:
        """Fold in one record of this choice's completion (``RequestOutputKind.DELTA``: what it adds)."""
        self.text += completion.text
        self.token_ids += completion.token_ids
        if completion.index == 0:
            self.prompt.cached_tokens = out.num_cached_tokens or 0
        if completion.logprobs is not None:
            self.logprobs = (self.logprobs or []) + completion.logprobs
        if out.prompt_logprobs is not None:
            self.prompt.logprobs = out.prompt_logprobs
        if completion.finished():
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason

    def take(self) -> tuple[str, list[int], list[LogprobEntry], int]:
        """The next piece of the response (a stream's chunk, or the whole): the text and the
        tokens not taken before, the tokens' logprob entries, and the character offset it starts
        at. The first piece starts with the echoed prompt. A chunk is only sent with text (or a
        finish), so tokens whose text is held back (half a character, a possible stop string)
        bring their logprobs in the next one."""
        text = self.text[self.sent_text :]
        ids = self.token_ids[self.sent_tokens :]
        entries = padded((self.logprobs or [])[self.sent_tokens :], len(ids))
        offset = self.sent_chars
        prompt = self.prompt
        if prompt.echo is not None and not self.echoed:
            self.echoed = True
            if self.echo_only:  # the one sampled token stays out, as in vLLM
                text, ids, entries = "", [], []
            prompt_entries = padded(prompt.logprobs or [], len(prompt.token_ids))
            text, ids, entries = prompt.echo + text, [*prompt.token_ids, *ids], [*prompt_entries, *entries]
        self.sent_text = len(self.text)
        self.sent_tokens = len(self.token_ids)
        self.sent_chars += len(text)
        return text, ids, entries, offset

    def prompt_logprobs_field(self) -> list[dict[int, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` field (None if the engine reported none)."""
        return None if self.prompt.logprobs is None else prompt_logprobs_json(self.prompt.logprobs)


@dataclass
class Choices:
    """A response's choices in vLLM's order: completion ``k`` (``RequestOutput.index``) of prompt
    ``p`` is choice ``p * n + k``, so a chat's are its completions' indices and a batch of
    prompts lists each prompt's ``n`` together. Usage counts each prompt once (its
    ``cached_tokens`` those of its completion 0) and every choice's generated tokens."""

    prompts: list[PromptState]
    n: int
    items: list[Choice]

    @classmethod
    def build(cls, prompts: list[PromptState], n: int, echo_only: bool, echo_logprobs: bool) -> Choices:
        return cls(prompts, n, [Choice(p, echo_only, echo_logprobs) for p in prompts for _ in range(n)])

    def update(self, prompt_index: int, out: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Fold ``out`` (an output of prompt ``prompt_index``'s request) into its choices; returns
        each choice's index with the completion record it took. A completion with finish reason
        "error" raises (:func:`raise_if_error`)."""
        updated = []
        for completion in out.outputs:
            raise_if_error(completion)
            i = prompt_index * self.n + completion.index
            self.items[i].update(out, completion)
            updated.append((i, completion))
        return updated

    def usage(self) -> dict[str, Any]:
        return usage(
            sum(len(p.token_ids) for p in self.prompts),
            sum(c.completion_tokens for c in self.items),
            sum(p.cached_tokens for p in self.prompts),
        )


def raise_if_error(completion: CompletionOutput) -> None:
    """vLLM's rule for finish reason "error": the engine could not go on with the request, and
    the response is a 500 (an error event in a stream) rather than a choice cut short."""
    if completion.finish_reason == "error":
        why = completion.error or "the engine ended the request"
        raise APIError(f"Internal server error: {why}", status_code=500)


def api_error(exc: ValueError, field_names: dict[str, str]) -> APIError:
    """The 400 for an engine's refusal; the body field it blames comes from the error's data
    (``field_names`` maps engine argument names to the body's where they differ)."""
    if isinstance(exc, ParameterError):
        return APIError(str(exc), param=field_names.get(exc.param, exc.param), code=exc.code)
    return APIError(str(exc))


class OpenAIServing:
    """``/v1/completions`` and ``/v1/chat/completions`` over an :class:`AsyncLLM`.

    ``input_processor`` is the engine's (``InputProcessor.with_tokenizer``: the same checks with
    the server's own tokenizer instance, used from worker threads while the engine thread
    detokenizes with its own). ``default_sampling_params`` are the model's own sampling defaults
    (:func:`generation_config_defaults`), for requests that leave a field unset. ``tool_parser``
    (``tool_calling.TOOL_PARSERS``; None: no "auto" tool choice) finds tool calls. ``limits``
    bound what one request may ask for (:class:`config.ServingLimits`). Bodies are prepared, and
    whole responses rendered, in :data:`PREPARE_WORKERS` threads at the lowest CPU priority
    (:func:`lowest_cpu_priority`): the requests already running come first, and the event loop
    that streams every client's tokens only reads and routes.
    """

    def __init__(
        self,
        llm: AsyncLLM,
        served_model_names: str | Sequence[str],
        input_processor: InputProcessor,
        default_sampling_params: Mapping[str, Any] | None = None,
        scheduling_policy: str = "fcfs",
        limits: ServingLimits | None = None,
        log_requests: bool = False,
        tool_parser: str | None = None,
    ) -> None:
        self.llm = llm
        self.log_requests = log_requests
        self.tool_parser = tool_parser  # --tool-call-parser, with --enable-auto-tool-choice: "auto" tool calls
        self.scheduling_policy = scheduling_policy
        self.limits = limits or ServingLimits()
        self.default_sampling_params = dict(default_sampling_params or {})
        names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
        self.served_model_names = names
        self.served_model_name = names[0]  # the one responses carry, as vLLM's do
        self.input_processor = input_processor
        self.tokenizer = input_processor.tokenizer
        self.max_model_len = input_processor.config.max_model_len
        self.vocab_size = input_processor.config.vocab_size
        self.executor = ThreadPoolExecutor(
            PREPARE_WORKERS, thread_name_prefix="prepare", initializer=lowest_cpu_priority
        )

    def shutdown(self) -> None:
        """Stop the preparation threads; bodies not started yet are dropped."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(
                f"The model `{model}` does not exist.", status_code=404, param="model", code="model_not_found"
            )

    def prepare(
        self, body: OpenAIRequest, request_id: str
    ) -> tuple[SamplingParams, list[EngineCoreRequest], list[str] | None]:
        """The body's ``SamplingParams``, its prompts as engine requests ``<request_id>-<i>``,
        both checked by the engine's input processor, and the prompts' text where ``echo``
        shows it (else None); run in a worker thread. The engine streams every output's delta
        (``RequestOutputKind.DELTA``), which the response accumulates (:class:`Choice`)."""
        limits = self.limits
        try:
            fields = body.sampling_kwargs(self.default_sampling_params)
            params = SamplingParams(**fields, output_kind=RequestOutputKind.DELTA)
            if len(params.stop or ()) > limits.max_stop_strings:
                raise APIError(
                    f"stop holds {len(params.stop or ())} strings; this server takes at most "
                    f"{limits.max_stop_strings} (max_stop_strings)",
                    param="stop",
                )
            if isinstance(body, ChatCompletionRequest):
                prompts: list[str | list[int]] = [self.render_chat(body.conversation(), **body.chat_options())]
            else:
                prompts = body.prompts()
                if len(prompts) > limits.max_completion_prompts:
                    raise APIError(
                        f"prompt holds {len(prompts)} prompts; this server takes at most "
                        f"{limits.max_completion_prompts} in one request (max_completion_prompts)",
                        param="prompt",
                    )
            # The OpenAI API refuses a max_tokens that cannot fit, where offline use cuts it.
            requests = [
                self.input_processor.process_inputs(
                    f"{request_id}-{i}", p, params, body.priority or 0, fit_max_tokens=False
                )
                for i, p in enumerate(prompts)
            ]
        except ValueError as exc:
            raise api_error(exc, body.field_names) from exc
        prompt_lens = [len(r.prompt_token_ids) for r in requests]
        self.check_kv_tokens(body, params, prompt_lens)
        self.check_response_size(body, params, prompt_lens)
        echo = isinstance(body, CompletionRequest) and body.echo
        if not echo:
            return params, requests, None
        return params, requests, [self.prompt_text(p, r.prompt_token_ids) for p, r in zip(prompts, requests)]

    def check_kv_tokens(self, body: OpenAIRequest, params: SamplingParams, prompt_lens: list[int]) -> None:
        """A 400 before any work when the request's sequences could hold more than
        ``max_request_kv_tokens`` tokens of KV cache (``n`` per prompt, each up to its prompt
        plus ``max_tokens``): every decode step reads all of them, so they bound how long one
        request can make everyone's step. Names ``n`` when it is above 1, else ``max_tokens``."""
        room = self.max_model_len
        total = params.n * sum(min(room, length + (params.max_tokens or room)) for length in prompt_lens)
        limit = self.limits.max_request_kv_tokens
        if total <= limit:
            return
        asked = "until the context is full" if params.max_tokens is None else f"max_tokens={params.max_tokens}"
        raise APIError(
            f"this request's sequences could hold {total:,} tokens of KV cache ({len(prompt_lens)} prompt(s) of "
            f"{sum(prompt_lens):,} tokens in all, n={params.n}, {asked}); this server lets one request hold "
            f"{limit:,} (max_request_kv_tokens): ask for fewer completions or tokens",
            param="n" if params.n > 1 else body.field_names.get("max_tokens", "max_tokens"),
        )

    def check_response_size(self, body: OpenAIRequest, params: SamplingParams, prompt_lens: list[int]) -> None:
        """A 400 before any work when the response could carry more than
        ``max_response_logprobs`` logprob entries (:func:`response_logprobs`), naming the field
        that asks for most of them."""
        parts = response_logprobs(body, params, prompt_lens, self.max_model_len)
        total = sum(parts.values())
        limit = self.limits.max_response_logprobs
        if total <= limit:
            return
        field = max(parts, key=lambda name: parts[name])
        shown = ", ".join(f"{name}: {count:,}" for name, count in parts.items() if count)
        raise APIError(
            f"this request's response could carry {total:,} logprob entries ({shown}; n={params.n}); this "
            f"server sends at most {limit:,} in one response (max_response_logprobs): ask for fewer "
            "completions, tokens or logprobs",
            param=field,
        )

    def prompt_text(self, prompt: str | list[int], token_ids: list[int]) -> str:
        """A prompt's text as ``echo`` shows it: as given, or its token ids decoded (special
        tokens kept, as vLLM's renderer decodes them)."""
        if isinstance(prompt, str):
            return prompt
        return "" if self.tokenizer is None else str(self.tokenizer.decode(token_ids))

    def logprobs_renderer(self, body: OpenAIRequest) -> LogprobsRenderer | None:
        """How the response shows logprobs; None where the body asked for none."""
        if body.num_logprobs is None:
            return None
        return LogprobsRenderer(body.num_logprobs, self.tokenizer, bool(body.return_tokens_as_token_ids))

    def render_chat(self, conversation: list[dict[str, Any]], **options: Any) -> list[int]:
        # LLM.chat's rendering too (one source of truth); its ParameterError names "messages",
        # which prepare() turns into the 400.
        return render_chat(self.tokenizer, conversation, **options)[1]

    async def start(self, requests: list[EngineCoreRequest], body: OpenAIRequest) -> list[RequestStream]:
        """Add every prompt's request to the engine; on any refusal, abort the ones already added."""
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(await self.llm.add_request(request.request_id, request))
        except BaseException as exc:
            for s in streams:
                s.abort()
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), status_code=503) from exc
            if isinstance(exc, ValueError):
                raise api_error(exc, body.field_names) from exc
            raise
        return streams

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``POST /tokenize``: a prompt (or messages, through the chat template) to token
        ids, with ``count`` and ``max_model_len`` so a client can check that it fits."""
        self.check_model(body.model)

        def work() -> list[int]:
            try:
                if isinstance(body, TokenizeChatRequest):
                    conversation = message_dicts(body.messages)
                    text, ids = render_chat(
                        self.tokenizer,
                        conversation,
                        add_generation_prompt=body.add_generation_prompt,
                        continue_final_message=body.continue_final_message,
                        chat_template_kwargs=body.chat_template_kwargs,
                    )
                    if body.add_special_tokens and self.tokenizer is not None:  # vLLM encodes it so
                        ids = list(self.tokenizer.encode(text, add_special_tokens=True))
                    return ids
                if self.tokenizer is None:
                    raise APIError("this checkpoint has no tokenizer", param="prompt")
                return list(self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
            except ValueError as exc:
                raise api_error(exc, {}) from exc

        tokens = await asyncio.get_running_loop().run_in_executor(self.executor, work)
        result: dict[str, Any] = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs and self.tokenizer else None
        result["token_strs"] = strs
        return result

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``POST /detokenize``: token ids back to text (special tokens kept, as vLLM)."""
        self.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"tokens holds {bad}, outside the vocabulary [0, {self.vocab_size})", param="tokens")
        if self.tokenizer is None:
            raise APIError("this checkpoint has no tokenizer", param="tokens")
        tokenizer = self.tokenizer
        text = await asyncio.get_running_loop().run_in_executor(self.executor, tokenizer.decode, body.tokens)
        return {"prompt": str(text)}

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        """``POST /v1/completions``: ``n`` choices per prompt (:class:`Choices` orders them)."""
        return await self.create(body, raw)

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """``POST /v1/chat/completions``: ``n`` choices, each a ``message`` (``delta`` chunks when streamed)."""
        return await self.create(body, raw)

    async def create(self, body: OpenAIRequest, raw: Request) -> Response:
        """Either endpoint: the two differ only in ids, object names and the body of a choice."""
        self.check_model(body.model)
        body.check_supported()
        body.check_logprobs(self.limits.max_logprobs)
        if body.priority and self.scheduling_policy != "priority":
            # vLLM refuses it too: under fcfs a priority would be accepted and ignored.
            raise APIError(
                "priority is only honoured with --scheduling-policy priority; this server schedules "
                f"{self.scheduling_policy}",
                param="priority",
            )
        chat = isinstance(body, ChatCompletionRequest)
        extractor = None
        if isinstance(body, ChatCompletionRequest):
            body.check_tools(self.tool_parser)
            extractor = body.tool_extractor(self.tool_parser)
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{body.request_id}" if body.request_id else random_id(prefix)
        loop = asyncio.get_running_loop()
        params, requests, echoes = await loop.run_in_executor(self.executor, self.prepare, body, request_id)
        if self.log_requests:
            lengths = [len(r.prompt_token_ids) for r in requests]
            log.info("Received request %s: prompt tokens %s, params: %s", request_id, lengths, params)
        streams = await self.start(requests, body)
        states = [
            PromptState(r.prompt_token_ids, None if echoes is None else echoes[i]) for i, r in enumerate(requests)
        ]
        renderer = self.logprobs_renderer(body)
        echo_only = isinstance(body, CompletionRequest) and body.echo_only
        choices = Choices.build(states, params.n, echo_only, echoes is not None and renderer is not None)
        kind = ("chat.completion.chunk" if body.stream else "chat.completion") if chat else "text_completion"
        header = {"id": request_id, "object": kind, "created": now(), "model": self.served_model_name}
        if body.stream:
            events = self._events(streams, choices, header, body, renderer, extractor)
            return StreamingResponse(events, media_type="text/event-stream")
        await collect_or_abort(raw, streams, choices.update)
        scored = params.prompt_logprobs is not None
        content = await loop.run_in_executor(
            self.executor, render_response, header, choices, renderer, chat, scored, extractor
        )
        return Response(content, media_type="application/json")

    async def _events(
        self,
        streams: list[RequestStream],
        choices: Choices,
        header: dict[str, Any],
        body: OpenAIRequest,
        renderer: LogprobsRenderer | None,
        extractor: ToolCallExtractor | None = None,
    ) -> AsyncIterator[str]:
        """The SSE stream: a chunk per output that brings text or a finish, each holding the one
        choice it is about (so every choice gets exactly one chunk with its finish_reason), as
        vLLM streams them. A choice whose text is read for tool calls (``extractor``) sends its
        message in the chunk that finishes it, the calls as ``tool_calls`` deltas."""
        chat = isinstance(body, ChatCompletionRequest)
        holds_text = extractor is not None and extractor.extracts

        def event(
            i: int, content: dict[str, Any], logprobs: dict[str, Any] | None = None, finish_reason: str | None = None
        ) -> str:
            """A chunk about choice ``i``; a finished choice's reports its finish (and stop) reason."""
            c = choices.items[i]
            reason = finish_reason or c.finish_reason
            chunk = {**header, "choices": [choice(i, reason, content, c.stop_reason, logprobs)]}
            if body.continuous_usage:  # vLLM's: the choice's prompt and its tokens so far
                chunk["usage"] = usage(len(c.prompt.token_ids), c.completion_tokens, c.prompt.cached_tokens)
            return sse(chunk)

        def render(prompt_index: int, out: RequestOutput) -> str | None:
            events = []
            for i, completion in choices.update(prompt_index, out):
                c = choices.items[i]
                if not completion.finished() and not (completion.text and c.ready and not holds_text):
                    continue
                text, ids, entries, offset = c.take()
                logprobs = render_logprobs(renderer, chat, ids, entries, offset)
                if holds_text:
                    assert extractor is not None
                    message, reason = extractor.message(c.text, c.finish_reason)
                    events.append(event(i, {"delta": tool_call_delta(message)}, logprobs, reason))
                    continue
                content = {"delta": {"content": text} if text else {}} if chat else {"text": text}
                events.append(event(i, content, logprobs))
            return "".join(events) or None

        if chat:  # OpenAI's first chunk of each chat choice announces the role; content follows.
            for i in range(len(choices.items)):
                yield event(i, {"delta": {"role": "assistant", "content": ""}})
        async for chunk in stream_events(streams, render):
            yield chunk
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": choices.usage()})
        yield SSE_DONE


def dumps(value: Any) -> str:
    """JSON as the responses send it: compact, UTF-8 text, no NaN (Starlette's JSONResponse's)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def tool_call_delta(message: dict[str, Any]) -> dict[str, Any]:
    """A finished message as one stream delta: its content, and its calls with their ``index``."""
    delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    return delta


def render_response(
    header: dict[str, Any],
    choices: Choices,
    renderer: LogprobsRenderer | None,
    chat: bool,
    scored: bool,
    extractor: ToolCallExtractor | None = None,
) -> bytes:
    """A whole (non-streamed) response's JSON, rendered choice by choice in a worker thread.

    One ``json.dumps`` of the whole response holds the GIL, and so the event loop that streams
    every other client's tokens, for as long as the biggest response takes (seconds for tens of
    megabytes of logprobs). Rendered piece by piece, the longest hold is one choice; and a
    prompt's ``prompt_logprobs``, which vLLM repeats on each of its completions' choices, are
    rendered once and the same text is put in each. The layout is vLLM's: ``prompt_logprobs``
    on each choice for completions, beside the choices for chat. ``extractor`` reads a chat
    choice's text for tool calls.
    """
    rendered_prompts: dict[int, str] = {}

    def prompt_logprobs(c: Choice) -> str:
        key = id(c.prompt)
        if key not in rendered_prompts:
            rendered_prompts[key] = dumps(c.prompt_logprobs_field())
        return rendered_prompts[key]

    pieces = []
    for i, c in enumerate(choices.items):
        text, ids, entries, _ = c.take()
        reason = c.finish_reason
        if not chat:
            content: dict[str, Any] = {"text": text}
        elif extractor is None:
            content = {"message": {"role": "assistant", "content": text}}
        else:
            message, reason = extractor.message(text, reason)
            content = {"message": message}
        piece = dumps(choice(i, reason, content, c.stop_reason, render_logprobs(renderer, chat, ids, entries)))
        if scored and not chat:
            piece = f'{piece[:-1]},"prompt_logprobs":{prompt_logprobs(c)}}}'
        pieces.append(piece)
    tail = f',"usage":{dumps(choices.usage())}'
    if scored and chat:
        tail += f',"prompt_logprobs":{prompt_logprobs(choices.items[0])}'
    return f'{dumps(header)[:-1]},"choices":[{",".join(pieces)}]{tail}}}'.encode()


def response_logprobs(
    body: OpenAIRequest, params: SamplingParams, prompt_lens: list[int], max_model_len: int
) -> dict[str, int]:
    """The most logprob entries a response to ``body`` can carry, by the field that asks for
    them: each token shown with logprobs counts 1 + its top logprobs.

    The generated tokens' (``logprobs``, chat's ``top_logprobs``): ``n`` choices per prompt, each
    up to ``max_tokens`` (None: the context the prompt leaves). The echoed prompt's
    (completions' ``echo`` with logprobs), once per choice. ``prompt_logprobs``: once per choice
    for completions, once per response for chat, as vLLM lays them out.
    """
    chat = isinstance(body, ChatCompletionRequest)
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    n = params.n
    generated = echoed = scored = 0
    if params.logprobs is not None and not (isinstance(body, CompletionRequest) and body.echo_only):
        per_token = 1 + params.logprobs
        generated = n * sum(per_token * (params.max_tokens or max_model_len - length) for length in prompt_lens)
    if echo and body.num_logprobs is not None:
        echoed = n * (1 + body.num_logprobs) * sum(prompt_lens)
    if params.prompt_logprobs is not None and not body.stream:  # a stream cannot show the field
        per_prompt = (1 + params.prompt_logprobs) * sum(prompt_lens)
        scored = per_prompt if chat else n * per_prompt
    return {body.num_logprobs_field: generated, "echo": echoed, "prompt_logprobs": scored}


def choice(
    index: int,
    finish_reason: str | None,
    content: dict[str, Any],
    stop_reason: int | str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One entry of ``choices``: ``content`` is ``{"text": ...}``, ``{"message": ...}`` or ``{"delta": ...}``.

    ``stop_reason`` is vLLM's addition: the stop string or ``stop_token_ids`` entry that ended
    the choice (None for EOS, a length stop, or while it runs)."""
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def render_logprobs(
    renderer: LogprobsRenderer | None, chat: bool, token_ids: list[int], entries: list[LogprobEntry], offset: int = 0
) -> dict[str, Any] | None:
    """A choice's (or chunk's) ``logprobs`` object, None where none were asked for."""
    if renderer is None:
        return None
    return renderer.chat(token_ids, entries) if chat else renderer.completion(token_ids, entries, offset)


# The generation_config.json keys vLLM reads as sampling defaults (ModelConfig's
# get_diff_sampling_param), with the SamplingParams field each becomes.
GENERATION_CONFIG_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def generation_config_defaults(model_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sampling defaults in ``model_dir``'s ``generation_config.json``, as vLLM's default
    ``--generation-config auto`` takes them: the keys of :data:`GENERATION_CONFIG_KEYS` that the
    file sets (transformers' ``to_diff_dict``), renamed to ``SamplingParams`` fields.

    Returns ``(applied, not_applicable)``: the second holds the keys ``SamplingParams`` has no
    field for yet (they are applied, with no edit here, once it has). No file: two empty dicts.
    """
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except OSError:  # no generation_config.json: the engine's own defaults
        return {}, {}
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    found = {field: config[key] for key, field in GENERATION_CONFIG_KEYS.items() if config.get(key) is not None}
    applied = {k: v for k, v in found.items() if k in fields}
    return applied, {k: v for k, v in found.items() if k not in fields}


def lowest_cpu_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; on Linux niceness is per thread).

    Tokenizing a body near the size limit is most of a CPU-second of Rust that does not hold the
    GIL: it leaves the event loop free but takes a core from the engine's forward pass (on 2
    cores, three such bodies slowed a running stream to a token every 0.6 s).
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass  # not Linux, or refused: the work runs at normal priority
