"""The OpenAI endpoints' logic: a request body in, engine requests out, a response back.

Validation is the engine's: the body is turned into token ids and a :class:`SamplingParams`,
and whatever the engine refuses comes back as a :class:`ParameterError` naming the argument,
which becomes a 400 whose ``param`` is that name (``messages`` for a chat prompt). Text is
tokenized (and chat templates rendered) in a worker thread, never on the event loop that
streams the other clients' tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_from_scratch.async_llm import AsyncLLM, EngineDeadError, RequestStream
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, now,
                                               random_id, usage)
from vllm_from_scratch.sampling_params import SamplingParams
from vllm_from_scratch.streaming import SSE_DONE, collect_or_abort, sse, stream_events


@dataclass
class Choice:
    """What one choice accumulates while its request runs."""

    prompt_tokens: int
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None

    def update(self, out) -> None:
        self.text += out.new_text
        self.completion_tokens += len(out.new_token_ids)
        self.cached_tokens = out.num_cached_tokens or 0
        if out.finished:
            self.finish_reason = out.finish_reason


def api_error(exc: ValueError, field_names: dict[str, str]) -> APIError:
    """The 400 for an engine's refusal; the body field it blames comes from the error's data
    (``field_names`` maps engine argument names to the body's where they differ)."""
    if isinstance(exc, ParameterError):
        return APIError(str(exc), param=field_names.get(exc.param, exc.param), code=exc.code)
    return APIError(str(exc))


class OpenAIServing:
    """``/v1/completions`` and ``/v1/chat/completions`` over an :class:`AsyncLLM`.

    ``tokenizer`` is the server's own instance: it is used from worker threads, while the
    engine thread uses the engine's.
    """

    def __init__(self, llm: AsyncLLM, served_model_name: str, tokenizer, max_model_len: int):
        self.llm = llm
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model `{model}` does not exist.", status_code=404, param="model",
                           code="model_not_found")

    @staticmethod
    def sampling_params(body) -> SamplingParams:
        try:
            return SamplingParams(**body.sampling_kwargs())
        except ValueError as exc:
            raise api_error(exc, body.field_names) from exc

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(await asyncio.to_thread(self.tokenizer.encode, prompt))
        return list(prompt)

    async def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        conversation = body.conversation()
        return await asyncio.to_thread(self._render_chat, conversation)

    def _render_chat(self, conversation: list[dict[str, str]]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault
            raise APIError(f"cannot apply the chat template: {exc}", param="messages") from exc
        # The template already wrote the special tokens (BOS, role markers).
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def start(self, base_id: str, prompts: list[list[int]], params: SamplingParams,
                    body) -> list[RequestStream]:
        """Add every prompt to the engine; on any refusal, abort the ones already added."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.llm.add_request(f"{base_id}-{i}", ids, params, body.priority))
        except BaseException as exc:
            for s in streams:
                s.abort()
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), status_code=503) from exc
            if isinstance(exc, ValueError):
                raise api_error(exc, body.field_names) from exc
            raise
        return streams

    # ---- /v1/completions ------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        params = self.sampling_params(body)
        prompts = [await self.encode(p) for p in body.prompts()]
        request_id = random_id("cmpl")
        streams = await self.start(request_id, prompts, params, body)
        choices = [Choice(prompt_tokens=len(ids)) for ids in prompts]
        header = {"id": request_id, "object": "text_completion", "created": now(),
                  "model": self.served_model_name}
        if body.stream:
            return StreamingResponse(self._completion_events(streams, choices, header, body),
                                     media_type="text/event-stream")
        await collect_or_abort(raw, streams, lambda i, out: choices[i].update(out))
        return JSONResponse({
            **header,
            "choices": [{"index": i, "text": c.text, "logprobs": None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": total_usage(choices),
        })

    async def _completion_events(self, streams, choices, header, body):
        def chunk(i: int, text: str, finish_reason: str | None) -> str:
            return sse({**header, "choices": [{"index": i, "text": text, "logprobs": None,
                                               "finish_reason": finish_reason}]})

        async for event in stream_events(streams, lambda i, out: choices[i].update(out), chunk):
            yield event
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": total_usage(choices)})
        yield SSE_DONE

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        params = self.sampling_params(body)
        ids = await self.encode_chat(body)
        request_id = random_id("chatcmpl")
        streams = await self.start(request_id, [ids], params, body)
        choices = [Choice(prompt_tokens=len(ids))]
        header = {"id": request_id, "object": "chat.completion", "created": now(),
                  "model": self.served_model_name}
        if body.stream:
            header["object"] = "chat.completion.chunk"
            return StreamingResponse(self._chat_events(streams, choices, header, body),
                                     media_type="text/event-stream")
        await collect_or_abort(raw, streams, lambda i, out: choices[i].update(out))
        return JSONResponse({
            **header,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": choices[0].text},
                         "logprobs": None, "finish_reason": choices[0].finish_reason}],
            "usage": total_usage(choices),
        })

    async def _chat_events(self, streams, choices, header, body):
        def chunk(i: int, text: str | None, finish_reason: str | None, role: bool = False) -> str:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            return sse({**header, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                               "finish_reason": finish_reason}]})

        # OpenAI's first chunk announces the role; content follows in later deltas.
        yield chunk(0, None, None, role=True)
        async for event in stream_events(streams, lambda i, out: choices[i].update(out), chunk):
            yield event
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": total_usage(choices)})
        yield SSE_DONE


def total_usage(choices: list[Choice]) -> dict:
    return usage(sum(c.prompt_tokens for c in choices),
                 sum(c.completion_tokens for c in choices),
                 sum(c.cached_tokens for c in choices))
