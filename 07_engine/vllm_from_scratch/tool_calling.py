"""Tool calling as vLLM serves it: ``tools``, ``tool_choice``, ``parallel_tool_calls`` in, ``tool_calls`` out.

The tools go to the model's chat template (which writes them into the prompt in the model's own
format); what the model writes back becomes ``tool_calls`` in one of two ways:

- ``tool_choice`` ``"required"`` or a named function: the output is constrained by a JSON schema
  (``structured_output.py``), so even a small model writes a valid call: for a named function its
  arguments object, for ``"required"`` a list of ``{"name", "parameters"}`` objects over the tools
  (one at most when ``parallel_tool_calls`` is false). The text is then parsed as JSON.
- ``"auto"`` (the default when tools are given): the model decides, unconstrained, and a tool
  parser (``--tool-call-parser``, with ``--enable-auto-tool-choice``) finds the calls in its
  text in the model family's format: :class:`HermesToolParser` (``<tool_call>{...}</tool_call>``,
  Qwen2.5/Qwen3, Hermes, SmolLM3) or :class:`Llama3JsonToolParser` (Llama 3.1+'s bare
  ``{"name": ..., "parameters": ...}``).

``"none"`` renders the tools but parses nothing, as vLLM does.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from vllm_from_scratch.sampling_params import StructuredOutputsParams


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_call_id() -> str:
    """A fresh call id, in vLLM's spelling."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(
    tools: list[ChatCompletionTool], tool_choice: ToolChoice, parallel_tool_calls: bool | None
) -> StructuredOutputsParams | None:
    """The schema that makes the output a valid call for ``"required"`` and a named function;
    None for ``"auto"`` and ``"none"``. Compact JSON: whitespace between tokens is where a small
    model spends its budget, and the arguments are JSON text either way.
    The caller has checked that a named function is among ``tools``."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True)
    if tool_choice != "required":
        return None
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
                    "required": ["name", "parameters"],
                }
                for t in tools
            ],
        },
    }
    if parallel_tool_calls is False:
        calls["maxItems"] = 1
    return StructuredOutputsParams(json=calls, disable_any_whitespace=True)


def function_call(name: str, arguments: Any) -> dict[str, Any]:
    """One ``tool_calls`` entry; ``arguments`` is JSON text, as OpenAI sends it."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


class ToolParser:
    """Finds the tool calls in a model's text: ``(content, calls)``, content None when the text
    holds nothing besides the calls."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (a last one may be
    left open at EOS); the text before the first is the content. A block that is not such an
    object leaves the whole text as content, as vLLM's parser does."""

    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if "<tool_call>" not in text:
            return text, []
        try:
            found = [json.loads(block) for block in self.CALL.findall(text)]
            calls = [function_call(c["name"], c.get("arguments", {})) for c in found]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
        content = text[: text.index("<tool_call>")]
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+'s JSON tool calls: the text is ``{"name": ..., "parameters": {...}}`` objects,
    ``;``-separated, optionally after ``<|python_tag|>``."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                obj, end = decoder.raw_decode(body, at)
                calls.append(function_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
                at = end
                while at < len(body) and body[at] in "; \n":
                    at += 1
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


class ToolCallExtractor:
    """What a chat choice's text becomes for one request's ``tool_choice``: its message
    (``content`` and ``tool_calls``) and finish reason, vLLM's rules: ``"tool_calls"`` when
    ``"auto"`` found calls or ``"required"`` stopped, ``"stop"`` for a named function."""

    def __init__(self, tool_choice: ToolChoice, parser: ToolParser | None, parallel_tool_calls: bool | None):
        self.tool_choice = tool_choice
        self.parser = parser
        self.parallel_tool_calls = parallel_tool_calls

    @property
    def extracts(self) -> bool:
        """Whether the text is read for calls (else it is the content, as without tools)."""
        return self.tool_choice not in ("none", "auto") or (self.tool_choice == "auto" and self.parser is not None)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        if not self.extracts:
            return {"role": "assistant", "content": text}, finish_reason
        content: str | None
        if self.tool_choice == "auto":
            assert self.parser is not None
            content, calls = self.parser.parse(text)
            if calls:
                finish_reason = "tool_calls"
        else:
            content, calls = "", constrained_calls(text, self.tool_choice)
            if self.tool_choice == "required" and finish_reason == "stop":
                finish_reason = "tool_calls"
        if self.parallel_tool_calls is False:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, finish_reason


def constrained_calls(text: str, tool_choice: ToolChoice) -> list[dict[str, Any]]:
    """The calls in a constrained output: a named function's arguments, or ``"required"``'s list.
    Text that does not parse (cut by ``max_tokens``) has none."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(tool_choice, NamedToolChoice):
        return [function_call(tool_choice.function.name, value)]
    return [function_call(c["name"], c["parameters"]) for c in value]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's ``tool_calls`` arguments as objects
    (OpenAI sends them as JSON text; Qwen's and Llama's templates iterate over them)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_arguments_as_object(c) for c in calls]}
        out.append(message)
    return out


def _arguments_as_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call
