"""Structured outputs and tool calling over the OpenAI API, with the openai SDK as clients use it:
``.parse(PydanticModel)``, ``response_format``, vLLM's ``structured_outputs``, ``tools`` with every
``tool_choice``, streamed and not; bad constraints are 400s naming their field."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from server_testing import ServerProcess
from vllm_from_scratch.tool_calling import HermesToolParser, Llama3JsonToolParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
REPO = Path(__file__).resolve().parents[2]
LANGCHAIN_PYTHON = REPO / ".venv-langchain" / "bin" / "python"
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Book(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=12)
    year: int = pydantic.Field(ge=1900, le=2030)


@pytest.fixture(scope="module")
def server():
    args = ["vllm_from_scratch.serve", "--dtype", "float32", "--max-model-len", "512", "--num-kvcache-blocks", "128"]
    args += ["--enforce-eager", "--max-num-seqs", "8", "--log-level", "warning", "--no-warm-up"]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    with ServerProcess(args, startup_timeout_s=180) as running:
        yield running.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="EMPTY", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.mark.slow
def test_the_sdk_parses_a_pydantic_model(client, model):
    messages = [{"role": "user", "content": "Name a book as JSON."}]
    response = client.chat.completions.parse(
        model=model, messages=messages, response_format=Book, n=2, seed=3, max_tokens=64
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Book)


@pytest.mark.slow
def test_streamed_schema_and_choice_validate(client, model):
    schema = Book.model_json_schema()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A book, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": schema, "strict": True}},
        n=2,
        temperature=1.0,
        seed=5,
        max_tokens=64,
        stream=True,
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    body = {"structured_outputs": {"choice": ["yes", "no"]}}
    response = client.completions.create(
        model=model, prompt="Yes or no?", n=3, temperature=1.0, max_tokens=4, extra_body=body
    )
    assert {c.text for c in response.choices} <= {"yes", "no"}


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"jsonn": {}}}, "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(server, body, param):
    response = httpx.post(server + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(server + "/health").status_code == 200


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.slow
def test_required_and_named_tool_choice_always_give_a_valid_call(client, model):
    one_call = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64
    )
    required = client.chat.completions.create(**one_call, n=2, seed=1)
    for c in required.choices:
        assert c.finish_reason == "tool_calls"
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, PARAMETERS)
    named = {"type": "function", "function": {"name": "add"}}
    forced = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, seed=2, max_tokens=48
    )
    for c in forced.choices:
        assert c.finish_reason == "stop"
        _check_calls(c.message.tool_calls, ["add"])
    stream = client.chat.completions.create(**one_call, stream=True)
    deltas = [d for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0]
    _check_calls(deltas, PARAMETERS)


@pytest.mark.slow
def test_tool_choice_none_and_a_tool_result_follow_up(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
    }
    follow_up = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "21 C"},
    ]
    answer = client.chat.completions.create(model=model, messages=follow_up, tools=TOOLS, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.slow
@pytest.mark.skipif(
    not LANGCHAIN_PYTHON.exists(),
    reason="LangChain is optional: build .venv-langchain with 07_engine/benchmarks/make_langchain_venv.sh",
)
def test_langchain_structured_output_and_bind_tools_run_unchanged(server):
    script = REPO / "07_engine" / "benchmarks" / "langchain_check.py"
    done = subprocess.run(
        [str(LANGCHAIN_PYTHON), str(script), "--base-url", server + "/v1"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    checks = [json.loads(line) for line in done.stdout.splitlines()]
    assert [c["check"] for c in checks] == [
        "with_structured_output(json_schema)",
        "with_structured_output(function_calling)",
        "with_structured_output(json_mode)",
        "bind_tools(required)",
    ]


def test_hermes_parser_reads_calls_and_keeps_the_text_before():
    text = (
        'Let me check.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    )
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])
    assert HermesToolParser().parse("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_llama3_json_parser_reads_calls():
    content, calls = Llama3JsonToolParser().parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "x", "parameters": {}}'
    )
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "x"]
    assert Llama3JsonToolParser().parse("Hello") == ("Hello", [])
