"""The OpenAI wire format the server speaks: request models and error bodies.

The models check the JSON's *shape*; its *values* are the engine's to judge (``SamplingParams``
and ``InputProcessor.process_inputs``), so each rule is written once. No field is silently ignored:
every field OpenAI's or vLLM's API defines is listed once (:data:`COMPLETION_FIELDS`,
:data:`CHAT_FIELDS`); a ``SamplingParams`` field passes straight to the engine, one the engine
cannot honour (``best_of`` > 1, tools, ...) is refused with a 400 naming it unless it asks for
nothing, and a field no API defines is refused too: a client that asks for three samples and
gets one, or misspells ``temperature``, has a bug it cannot see. The logprobs fields and
completions' ``echo`` are declared on the models: they change the response, which the server
renders (``openai_logprobs``), as well as the ``SamplingParams``. ``n`` passes to the engine
like any sampling field; the server lays out its choices from the validated ``SamplingParams.n``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.types import FailFast
from typing_extensions import TypeAliasType, TypeIs

from vllm_from_scratch.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_from_scratch.tool_calling import (
    TOOL_PARSERS,
    ChatCompletionTool,
    NamedToolChoice,
    ToolCallExtractor,
    ToolChoice,
    template_messages,
    tool_constraint,
)


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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, usage in every chunk


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is how a schema is always
    read here: no property it does not list)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (a JSON value valid under ``json_schema.schema``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


# ---- every request field OpenAI's API or vLLM's server defines, written once ------------------
#
# Each known field maps to the values that mean "this feature is not asked for" (None, an
# explicit JSON null, always does: SDKs that send every field send nulls). A field is then one of:
#   * handled by the server itself: declared on the models below (``model``, ``stream``, ...);
#   * a ``SamplingParams`` field: passed straight to the engine, whose own checks judge it, so a
#     field the engine gains (``min_p``, penalties, ...) is accepted with no edit here;
#   * neither: *known but not supported*; a value other than its neutral ones is a 400 naming it.
# Anything not listed is a 400 too: a misspelt ``temprature`` must not sample at temperature 1.
# Sources: OpenAI's ``completions.create`` / ``chat.completions.create`` parameters and vLLM's
# ``CompletionRequest`` / ``ChatCompletionRequest`` (``vllm/entrypoints/openai/protocol.py``).
SHARED_FIELDS: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "model": (),
    "temperature": (),
    "top_p": (),
    "max_tokens": (),
    "stop": (),
    "seed": (),
    "stream": (),
    "stream_options": (),
    "n": (1,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "logit_bias": ({},),
    "logprobs": (),
    "user": (),
    # vLLM's sampling parameters (its "extra body")
    "top_k": (),
    "min_p": (0.0,),
    "repetition_penalty": (1.0,),
    "length_penalty": (1.0,),
    "use_beam_search": (False,),
    "stop_token_ids": (),
    "ignore_eos": (),
    "min_tokens": (0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "echo": (False,),
    "response_format": ({"type": "text"},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structured_outputs": (),
    "priority": (),
    "request_id": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
}
COMPLETION_FIELDS: dict[str, tuple[Any, ...]] = {
    **SHARED_FIELDS,
    "prompt": (),
    "best_of": (1,),
    "suffix": ("",),
    "add_special_tokens": (True,),  # vLLM's default here: the tokenizer's BOS, as encode_prompt adds
    "prompt_embeds": (),
}
CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    **SHARED_FIELDS,
    "messages": (),
    "max_completion_tokens": (),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True,),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "metadata": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "prompt_cache_key": (),
    "prompt_cache_retention": (),
    "prompt_cache_options": (),
    "moderation": (),
    "safety_identifier": (),
    "include_reasoning": (True,),
    "add_special_tokens": (False,),  # the template already wrote them
    "add_generation_prompt": (),
    "continue_final_message": (),
    "documents": (),
    "chat_template": (),
    "chat_template_kwargs": (),
    "mm_processor_kwargs": (),
}
# Fields whose effect shows in the *response* (logprobs, the prompt echoed) under names or
# shapes that are not SamplingParams': passing them to the engine by name is not enough, the
# server has to render them. The models declare those it renders (logprobs, echo) and map them
# to SamplingParams (:meth:`_SamplingFields.sampling_kwargs`); the rest are refused unless
# neutral. (``n`` is not one: it means the same to the engine, which validates it, and the
# server reads the count back from the SamplingParams.)
# ``structured_outputs`` is one too: the body's dict becomes a StructuredOutputsParams.
RESPONSE_FIELDS = frozenset({"best_of", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "structured_outputs"})
# Known fields whose refusal says more than "not supported": what to ask for instead.
REFUSAL_REASONS = {
    "best_of": (
        "vLLM removed best_of (only null or 1 is accepted); ask for n completions with logprobs "
        "and keep the one whose token logprobs sum highest"
    ),
}
# Fields that only identify the caller to the provider (OpenAI's abuse monitoring): accepting
# them with no effect on the output is what they mean.
IDENTIFYING_FIELDS = frozenset({"user", "safety_identifier"})


def engine_fields(known: Iterable[str]) -> frozenset[str]:
    """The request fields that pass straight into ``SamplingParams``: those of its dataclass
    fields an API defines, less :data:`RESPONSE_FIELDS`. Read from the class each time, so a
    field added to ``SamplingParams`` is accepted at once."""
    return frozenset({f.name for f in dataclasses.fields(SamplingParams)} & set(known)) - RESPONSE_FIELDS


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """``value`` asks for nothing: null, or one of the field's neutral values (``1`` equals
    ``1.0``, but ``true`` never equals ``1``)."""
    if value is None:
        return True
    for n in neutral:
        if isinstance(value, bool) or isinstance(n, bool):
            if isinstance(value, bool) and isinstance(n, bool) and value == n:
                return True
        elif value == n:
            return True
    return False


class _SamplingFields(BaseModel):
    """Fields both endpoints share. Every other field is kept (``extra="allow"``) and judged by
    :meth:`check_supported` against :attr:`KNOWN_FIELDS`: passed to the engine, or refused by name.

    A field typed ``X | None`` takes an explicit null as "the default".
    """

    model_config = ConfigDict(extra="allow")
    KNOWN_FIELDS: ClassVar[dict[str, tuple[Any, ...]]] = SHARED_FIELDS

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | FirstErrorList[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra body fields (the openai client sends them with extra_body=).
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: FirstErrorList[int] | None = None
    priority: int | None = None  # lower first, with the server's --scheduling-policy priority
    request_id: str | None = None  # vLLM's: the response's id (and the engine's), else random
    # vLLM's: each prompt token's logprob and this many more (the response's prompt_logprobs).
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprobs name tokens "token_id:N"
    # A constraint on the output: OpenAI's response_format, or vLLM's structured_outputs (the
    # fields of StructuredOutputsParams: json, regex, choice, grammar, json_object, ...).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    if TYPE_CHECKING:
        # Each endpoint declares its own, with its own default and place in the field order (the
        # order validation errors are listed in).
        max_tokens: int | None

    def check_supported(self) -> None:
        """Refuse what the engine cannot do, naming the field (400): a field no API defines, and
        a known one the engine does not implement set to anything but its neutral value (beam
        search, guided decoding, tools, ...), with its :data:`REFUSAL_REASONS` entry if it has one."""
        extra = self.model_extra or {}
        for name in extra:
            if name not in self.KNOWN_FIELDS:
                raise APIError(
                    f"unknown field: {name} (neither OpenAI's nor vLLM's API defines it for this endpoint)",
                    param=name,
                    code="unknown_field",
                )
        handled = set(type(self).model_fields) | engine_fields(self.KNOWN_FIELDS) | IDENTIFYING_FIELDS
        for name, value in self.given_fields().items():
            if name not in handled and not _is_neutral(value, self.KNOWN_FIELDS[name]):
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."  # a body may be big
                reason = f"; {REFUSAL_REASONS[name]}" if name in REFUSAL_REASONS else ""
                message = f"not supported by this engine: {name}={shown}{reason}"
                raise APIError(message, param=name, code="unsupported_field")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: top logprobs per generated token (None: no logprobs)."""
        raise NotImplementedError

    @property
    def num_logprobs_field(self) -> str:
        """The body field :attr:`num_logprobs` comes from."""
        return "logprobs"

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs`` (None: the prompt is not scored)."""
        return self.prompt_logprobs

    def check_logprobs(self, max_logprobs: int) -> None:
        """vLLM's rules for the logprobs fields, each a 400 naming the field: no
        ``prompt_logprobs`` in a stream, and no more top logprobs than ``max_logprobs`` (vLLM's
        default 20). A negative count is ``SamplingParams``' to refuse."""
        if self.prompt_logprobs is not None and self.stream:
            # vLLM refuses > 0; 0 too here, as a stream has no place to show them.
            raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        for field, count in ((self.num_logprobs_field, self.num_logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if count is not None and count > max_logprobs:
                raise APIError(f"{field} must be at most {max_logprobs} (max_logprobs), got {count}", param=field)

    def given_fields(self) -> dict[str, Any]:
        """Every field the body set (declared or not), with its value; nulls included."""
        given = {name: getattr(self, name) for name in self.model_fields_set if name in type(self).model_fields}
        return {**given, **(self.model_extra or {})}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: every chunk carries its choice's usage so far. As
        in vLLM it needs ``include_usage`` too (alone it asks for nothing)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        """The body field each engine argument came from, where the names differ."""
        return self._constraint_field_names()

    def _constraint_field_names(self) -> dict[str, str]:
        """A constraint from ``response_format`` is blamed on it, whatever the engine calls it."""
        if self.structured_outputs is not None or self.response_format is None:
            return {}
        return {f"structured_outputs.{kind}": "response_format" for kind in ("json", "json_object")}

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``SamplingParams.structured_outputs`` from ``structured_outputs`` or ``response_format``
        (one of them: both is a 400)."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise APIError("cannot be given with response_format", param="structured_outputs")
            known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise APIError(f"structured_outputs has unknown keys {unknown}", param="structured_outputs")
            return StructuredOutputsParams(**self.structured_outputs)
        return None if self.response_format is None else self.response_format.structured_outputs()

    def sampling_kwargs(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams``: every field the body set to something other
        than null that ``SamplingParams`` has (:func:`engine_fields`), else ``defaults`` (the
        model's ``generation_config.json``, as vLLM applies it), else the engine's own defaults.
        ``max_tokens`` None: up to the context left; a default ``max_tokens`` caps it."""
        given = self.given_fields()
        kwargs: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        for name in engine_fields(self.KNOWN_FIELDS):
            if given.get(name) is not None:
                kwargs[name] = given[name]
        for name, count in (("logprobs", self.num_logprobs), ("prompt_logprobs", self.num_prompt_logprobs)):
            if count is not None:
                kwargs[name] = count
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        constraint = self.structured_outputs_params()
        if constraint is not None:
            kwargs["structured_outputs"] = constraint
        max_tokens, cap = self.requested_max_tokens, (defaults or {}).get("max_tokens")
        kwargs["max_tokens"] = cap if max_tokens is None else min(max_tokens, cap) if cap is not None else max_tokens
        return kwargs


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt (text or token ids, one or a batch) to continue."""

    KNOWN_FIELDS: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_FIELDS

    prompt: str | FirstErrorList[int] | FirstErrorList[str] | FirstErrorList[FirstErrorList[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # each generated token's logprob and this many more
    echo: bool | None = False  # the prompt before the completion (its logprobs too, with logprobs)

    def check_supported(self) -> None:
        """The shared checks, which judge every field by this endpoint's table: ``best_of``
        other than 1, a ``suffix`` and ``prompt_embeds`` are refused there too."""
        super().check_supported()

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        # vLLM: echo scores the prompt as it scores the completion, unless prompt_logprobs says.
        return self.logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (OpenAI's way to score a prompt): the response is the
        prompt alone. vLLM's ``echo_without_generation``: the engine still samples one token
        (at least one step must run to score the prompt), which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        # An engine refusal of the prompt logprobs echo asked for blames echo.
        names = self._constraint_field_names()
        return {**names, "prompt_logprobs": "echo"} if self.prompt_logprobs is None and self.echo else names

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
    """One entry of ``messages``; its other fields (``name``, ...) are handed to the chat template."""

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


def message_dicts(messages: Iterable[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as the chat template takes them. A message's other fields (``name``,
    ``tool_call_id``, ...) go to the template, which decides what they mean, as in vLLM."""
    return [{**(m.model_extra or {}), "role": m.role, "content": m.text()} for m in messages]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    KNOWN_FIELDS: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_FIELDS

    messages: FirstErrorList[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # each generated token's logprob ...
    top_logprobs: int | None = None  # ... and this many more (null: 0)
    # vLLM's chat-template controls, handed to the one chat rendering (chat_utils.render_chat).
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (tool_calling.py): tool_choice null is "auto" with tools, else "none".
    tools: FirstErrorList[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def effective_tool_choice(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def check_tools(self, tool_parser: str | None) -> None:
        """vLLM's rules, each a 400 naming the field: a tool_choice other than "none" needs
        tools, a named function must be one of them, "auto" needs the server's tool parser
        (``--enable-auto-tool-choice --tool-call-parser``), and a call forced by a grammar
        leaves no room for another constraint."""
        choice = self.effective_tool_choice
        if choice != "none" and not self.tools:
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        names = {t.function.name for t in self.tools or ()}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            name = choice.function.name
            raise APIError(
                f"The tool {name!r} in `tool_choice` is not one of `tools` ({sorted(names)})", param="tool_choice"
            )
        if choice == "auto" and tool_parser is None:
            # tools alone ask for "auto" by default: the field the client sent is the one named
            field = "tool_choice" if self.tool_choice is not None else "tools"
            raise APIError(
                f'{field}: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param=field,
            )
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and (
            self.structured_outputs is not None
            or (self.response_format is not None and self.response_format.type != "text")
        ):
            raise APIError(
                "a required or named tool_choice cannot be combined with another constraint", param="tool_choice"
            )

    def tool_extractor(self, tool_parser: str | None) -> ToolCallExtractor:
        parser = TOOL_PARSERS[tool_parser]() if tool_parser is not None and self.tools else None
        return ToolCallExtractor(self.effective_tool_choice, parser, self.parallel_tool_calls)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A required or named ``tool_choice``'s schema, else the shared rules'."""
        forced = tool_constraint(self.tools or [], self.effective_tool_choice, self.parallel_tool_calls)
        return forced if forced is not None else super().structured_outputs_params()

    def check_logprobs(self, max_logprobs: int) -> None:
        """The shared rules, after vLLM's two for ``top_logprobs``: not negative, and not above
        0 unless ``logprobs`` is true (0 with ``logprobs: false`` asks for nothing)."""
        top = self.top_logprobs
        if top is not None and top < 0:
            raise APIError(f"top_logprobs must be >= 0, got {top}", param="top_logprobs")
        if top and not self.logprobs:
            raise APIError(f"top_logprobs={top} needs logprobs set to true", param="top_logprobs")
        super().check_logprobs(max_logprobs)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_logprobs_field(self) -> str:
        return "top_logprobs"

    @property
    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for max_completion_tokens; vLLM takes either.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        names = {**self._constraint_field_names(), "prompt": "messages"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def chat_options(self) -> dict[str, Any]:
        """``render_chat``'s keyword arguments (null: vLLM's defaults)."""
        return {
            # Unset beside continue_final_message: off, as the two cannot both hold.
            "add_generation_prompt": self.add_generation_prompt is not False
            and ("add_generation_prompt" in self.model_fields_set or not self.continue_final_message),
            "continue_final_message": bool(self.continue_final_message),
            "chat_template_kwargs": self.chat_template_kwargs,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
        }

    def conversation(self) -> list[dict[str, Any]]:
        return template_messages(message_dicts(self.messages))


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with a ``prompt``; any other field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with ``messages``, rendered as ``/v1/chat/completions`` renders them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: FirstErrorList[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: ``tokens`` back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: FirstErrorList[int]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())
