"""The OpenAI wire format the server speaks: request models and error bodies.

The models check the JSON's *shape*; its *values* are the engine's to judge (``SamplingParams``
and ``LLMEngine.make_request``), so each rule is written once. Fields the OpenAI API defines but
this engine cannot honour (``n > 1``, ``logprobs``, penalties, tools, ...) are refused with a 400
naming the field, not silently ignored: a client that asks for three samples and gets one has a
bug it cannot see.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.types import FailFast
from typing_extensions import TypeAliasType, TypeIs


class APIError(Exception):
    """An error the client caused (or the server hit), rendered as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _default_error_type(status_code)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _default_error_type(status_code: int) -> str:
    if status_code == 404:
        return "not_found_error"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, the shape the openai client parses."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


T = TypeVar("T")

# A list whose validation stops at its first bad item. Validation holds the event loop, and
# pydantic otherwise reports every item's error in every union branch: 150,000 bad numbers in a
# 600 KB "prompt" cost 1.3 s and 440,000 errors, against 0.4 ms and 4 errors this way. (A type
# alias, because FailFast cannot be hashed into a Union directly.)
FirstErrorList = TypeAliasType("FirstErrorList", Annotated[list[T], FailFast()], type_params=(T,))


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share; ``model_config`` lets unknown fields through, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | FirstErrorList[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, Any] | None = None  # refused whatever it holds
    user: str | None = None
    # vLLM's extra body fields (the openai client sends them with extra_body=).
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: FirstErrorList[int] | None = None
    priority: int = 0  # lower first, with the server's --scheduling-policy priority
    if TYPE_CHECKING:
        # Each endpoint declares its own, with its own default and place in the field order (the
        # order validation errors are listed in).
        max_tokens: int | None

    def check_supported(self) -> None:
        """Refuse what the engine cannot do, naming the field (400)."""
        if self.n != 1:
            raise APIError(f"n={self.n} is not supported: this server returns one choice (n=1)", param="n")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise APIError(f"{param} is not supported by this engine", param=param)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this engine", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        """The body field each engine argument came from, where the names differ."""
        return {}

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams``; unset fields keep the engine's defaults
        (``max_tokens`` None: up to the context left)."""
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        kwargs: dict[str, Any] = {k: v for k, v in optional.items() if v is not None}
        kwargs.update(max_tokens=self.requested_max_tokens, ignore_eos=self.ignore_eos)
        if self.stop:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = list(self.stop_token_ids)
        return kwargs


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt (text or token ids, one or a batch) to continue."""

    prompt: str | FirstErrorList[int] | FirstErrorList[str] | FirstErrorList[FirstErrorList[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise APIError("logprobs is not supported by this engine", param="logprobs")
        if self.echo:
            raise APIError("echo is not supported by this engine", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(f"best_of={self.best_of} is not supported (only 1)", param="best_of")
        if self.suffix:
            raise APIError("suffix is not supported by this engine", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (OpenAI allows four shapes)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if _is_token_ids(p):
            return [list(p)]
        return list(p)


def _is_token_ids(prompt: list[int] | list[str] | list[list[int]]) -> TypeIs[list[int]]:
    """One prompt of token ids, rather than a batch of prompts."""
    return all(isinstance(x, int) for x in prompt)


class ChatMessage(BaseModel):
    """One entry of ``messages``; fields this server does not read (``name``, ...) pass through."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | FirstErrorList[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(f"content part type {part.get('type')!r} is not supported (text only)", param="messages")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: FirstErrorList[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: FirstErrorList[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise APIError("logprobs is not supported by this engine", param="logprobs")
        if self.tools:
            raise APIError("tools are not supported by this engine", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError("response_format other than text is not supported", param="response_format")

    @property
    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for max_completion_tokens; vLLM takes either.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        names = {"prompt": "messages"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())
