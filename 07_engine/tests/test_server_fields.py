"""No request field is silently ignored, and vLLM's server surface beyond the OpenAI routes.

Every field OpenAI's or vLLM's API defines is sent with a value that asks for something; each
must either reach the engine (``SamplingParams`` holds the value), be one the server handles
itself (tested on its own below), or be refused with a 400 naming it. Also: explicit nulls,
unknown fields, ``/tokenize``, ``/detokenize``, ``/version``, ``/ping``, the model id, the
model's ``generation_config.json`` defaults and vLLM's request-timing metric families.

Against ``test_server_protocol``'s scripted engine: fast, in-process, every value exact.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

import test_server_protocol
from test_server_protocol import KEY, MODEL, ScriptedEngine, assert_error
from vllm_from_scratch import serve
from vllm_from_scratch.api_server import VERSION, build_app
from vllm_from_scratch.default_model import MODEL_NAME
from vllm_from_scratch.openai_protocol import CHAT_FIELDS, COMPLETION_FIELDS, IDENTIFYING_FIELDS, engine_fields
from vllm_from_scratch.serving import generation_config_defaults

HI = [{"role": "user", "content": "hi"}]
BASES = {"/v1/completions": {"prompt": [10, 11], "max_tokens": 2}, "/v1/chat/completions": {"messages": HI}}
ENDPOINT_FIELDS = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}

# A value asking for something, for every field either API defines (the endpoint's own first).
ASKING = {
    "temperature": 0.5,
    "top_p": 0.5,
    "max_tokens": 3,
    "stop": ["zz"],
    "seed": 7,
    "stream": True,
    "stream_options": {"include_usage": True},
    "n": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.0},
    "user": "someone",
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "length_penalty": 0.5,
    "use_beam_search": True,
    "stop_token_ids": [5],
    "ignore_eos": True,
    "min_tokens": 1,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 1,
    "allowed_token_ids": [10, 11],
    "bad_words": ["x"],
    "prompt_logprobs": 1,
    "echo": True,
    "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a"],
    "guided_grammar": 'root ::= "a"',
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "structured_outputs": {"regex": "a+"},
    "priority": -1,
    "request_id": "mine",
    "logits_processors": ["pkg.Processor"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1},
    "best_of": 2,
    "suffix": "end",
    "prompt_embeds": "AAAA",
    "max_completion_tokens": 3,
    "top_logprobs": 2,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "flex",
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"a": 1},
    "moderation": {"a": 1},
    "safety_identifier": "s",
    "include_reasoning": False,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "mm_processor_kwargs": {"a": 1},
}
ASKING_BY_ENDPOINT = {
    "/v1/completions": {"logprobs": 2, "add_special_tokens": False},
    "/v1/chat/completions": {"logprobs": True, "add_special_tokens": True},
}
# Handled by the server itself, each with its own test (here or in test_server_protocol).
SERVER_HANDLED = {
    "stream",
    "stream_options",
    "priority",
    "request_id",
    "max_completion_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    # rendered into the response: test_server_logprobs
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "return_tokens_as_token_ids",
    *IDENTIFYING_FIELDS,
    # turned into SamplingParams.structured_outputs, or read for tool calls: test_server_structured_outputs
    "response_format",
    "structured_outputs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
SKIPPED = {"model", "prompt", "messages"}  # the request itself (model: test_server_protocol)

# The protocol tests' fixtures: the default model's tokenizer, a scripted engine, a client of its app.
tokenizer = test_server_protocol.tokenizer
engine = test_server_protocol.engine
client = test_server_protocol.client


def test_every_known_field_has_a_value_to_send():
    assert set(COMPLETION_FIELDS) | set(CHAT_FIELDS) <= set(ASKING) | SKIPPED | {"logprobs", "add_special_tokens"}


def test_the_list_covers_openais_own_parameters():
    """Every parameter the official openai client's ``create`` methods define is in the list."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    def keys(module) -> set[str]:
        return set(module.CompletionCreateParamsBase.__annotations__)

    assert keys(completion_create_params) <= set(COMPLETION_FIELDS)
    assert keys(chat_params) <= set(CHAT_FIELDS)


@pytest.mark.parametrize("path", list(BASES))
def test_every_field_is_honoured_or_refused_by_name(client, engine, path):
    honoured, refused = [], []
    for field in sorted(set(ENDPOINT_FIELDS[path]) - SKIPPED):
        value = ASKING_BY_ENDPOINT[path].get(field, ASKING.get(field))
        body = {**BASES[path], field: value, "model": MODEL}
        if field == "stream_options":
            body["stream"] = True
        engine.params.clear()
        resp = client.post(path, json=body)
        if resp.status_code == 400:
            err = resp.json()["error"]
            assert err["param"] == field, (field, err)
            assert field in err["message"]
            refused.append(field)
            continue
        assert resp.status_code == 200, (field, resp.text)
        honoured.append(field)
        if field in SERVER_HANDLED:
            continue
        assert field in engine_fields(ENDPOINT_FIELDS[path]), f"{field} was accepted but reaches nothing"
        [params] = engine.params.values()
        got = getattr(params, field)
        want = {5: 1.0} if field == "logit_bias" else value
        assert got == want, (field, got, want)
    assert {"temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "n"} <= set(honoured)
    assert {"logprobs", "prompt_logprobs", "return_tokens_as_token_ids"} <= set(honoured)
    chat = "tools" in ENDPOINT_FIELDS[path]
    assert {"guided_json", *(("tools", "echo") if chat else ("best_of",))} <= set(refused)
    assert ("top_logprobs" in refused) == chat, "top_logprobs without logprobs: true is refused by name"
    assert ("echo" in honoured) == (not chat), "completions' echo is rendered, chat's is not implemented"


def test_refusals_say_the_field_is_not_supported(client):
    err = assert_error(client.post("/v1/completions", json={"prompt": "hi", "suffix": "!"}), 400, "suffix")
    assert err["message"] == "not supported by this engine: suffix='!'"


def test_best_of_is_refused_as_vllm_removed_it(client):
    """vLLM >= 0.19 has no best_of (null and 1 only): the refusal says what to ask for instead."""
    err = assert_error(client.post("/v1/completions", json={"prompt": "hi", "best_of": 2}), 400, "best_of")
    assert err["message"].startswith("not supported by this engine: best_of=2; vLLM removed best_of")
    assert "n completions with logprobs" in err["message"]
    for neutral in (None, 1):
        resp = client.post("/v1/completions", json={**BASES["/v1/completions"], "best_of": neutral})
        assert resp.status_code == 200, resp.text


def test_values_that_ask_for_nothing_are_accepted(client):
    neutral = {"n": 1, "best_of": 1, "echo": False, "response_format": {"type": "text"}, "suffix": ""}
    assert client.post("/v1/completions", json={**BASES["/v1/completions"], **neutral}).status_code == 200
    chat = {"logprobs": False, "top_logprobs": 0, "tool_choice": "none", "tools": [], "parallel_tool_calls": True}
    resp = client.post("/v1/chat/completions", json={**BASES["/v1/chat/completions"], **chat, "n": 1})
    assert resp.status_code == 200, resp.text
    assert_error(client.post("/v1/completions", json={"prompt": "hi", "n": True}), 400, "n")  # true is not 1


@pytest.mark.parametrize("path", list(BASES))
def test_explicit_nulls_mean_the_default(client, engine, path):
    nulls = dict.fromkeys(set(ENDPOINT_FIELDS[path]) - SKIPPED, None)
    resp = client.post(path, json={**BASES[path], **nulls, "model": None})
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] in ("text_completion", "chat.completion")  # stream: null is not streamed


def test_an_unknown_field_is_refused_by_name(client):
    err = assert_error(client.post("/v1/completions", json={"prompt": "hi", "temprature": 0.1}), 400, "temprature")
    assert "unknown field" in err["message"]
    err = assert_error(client.post("/v1/chat/completions", json={"messages": HI, "best_of": 2}), 400, "best_of")
    assert "unknown field" in err["message"], "best_of is a completions field, not a chat one"
    assert_error(
        client.post("/v1/completions", json={"prompt": "hi", "stream": True, "stream_options": {"x": 1}}),
        400,
        "stream_options",
    )


def test_request_id_names_the_response(client, engine):
    body = client.post("/v1/completions", json={**BASES["/v1/completions"], "request_id": "abc"}).json()
    assert body["id"] == "cmpl-abc"
    assert list(engine.priorities) == ["cmpl-abc-0"]


def test_priority_is_refused_where_the_engine_would_ignore_it(tokenizer):
    engine = ScriptedEngine(tokenizer)
    engine.config = SimpleNamespace(vocab_size=engine.vocab_size, scheduling_policy="fcfs")
    with TestClient(build_app(engine, MODEL)) as c:
        err = assert_error(c.post("/v1/completions", json={"prompt": "hi", "priority": 1}), 400, "priority")
        assert "--scheduling-policy priority" in err["message"]
        assert c.post("/v1/completions", json={"prompt": [10], "max_tokens": 1, "priority": 0}).status_code == 200


def test_chat_template_controls_change_the_rendered_prompt(client, tokenizer):
    def prompt_tokens(**fields) -> int:
        resp = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **fields})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    def rendered(**options) -> int:
        text = tokenizer.apply_chat_template(HI, tokenize=False, **options)
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert prompt_tokens() == rendered(add_generation_prompt=True)
    assert prompt_tokens(add_generation_prompt=False) == rendered(add_generation_prompt=False)
    assert prompt_tokens(continue_final_message=True) == rendered(continue_final_message=True)
    assert prompt_tokens() > prompt_tokens(add_generation_prompt=False)


def test_responses_carry_stop_reason(client):
    body = client.post("/v1/completions", json=BASES["/v1/completions"]).json()
    assert body["choices"][0]["stop_reason"] is None


# ---- vLLM's other routes ------------------------------------------------------------------------


def test_tokenize_a_prompt_and_messages(client, tokenizer):
    body = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    ids = tokenizer.encode("Hello world")
    assert body == {"count": len(ids), "max_model_len": ScriptedEngine.max_model_len, "tokens": ids, "token_strs": None}
    chat = client.post("/tokenize", json={"messages": HI, "return_token_strs": True}).json()
    text = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    assert_error(client.post("/tokenize", json={"prompt": "hi", "tools": []}), 400, "tools")
    assert_error(client.post("/tokenize", json={"prompt": "hi", "model": "other"}), 404, "model")
    for raw in (b'{"prompt": ', b"[1, 2]"):
        assert_error(client.post("/tokenize", content=raw, headers={"content-type": "application/json"}), 400)
    assert client.get("/health").status_code == 200


def test_detokenize_round_trips(client, tokenizer):
    ids = tokenizer.encode("Hello world")
    assert client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": "Hello world"}
    assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(client.post("/detokenize", json={"tokens": [1], "extra": 1}), 400, "extra")


def test_version_and_ping(client):
    assert client.get("/version").json() == {"version": VERSION}
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


def test_probes_are_open_and_the_rest_needs_the_key(engine):
    with TestClient(build_app(engine, MODEL, api_key=KEY)) as c:
        for method, path in (("get", "/ping"), ("post", "/ping"), ("get", "/version"), ("get", "/health")):
            assert getattr(c, method)(path).status_code == 200, path
        assert_error(c.post("/tokenize", json={"prompt": "hi"}), 401)
        assert_error(c.post("/detokenize", json={"tokens": [1]}), 401)
        ok = c.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200


# ---- the model id and the model's own sampling defaults -----------------------------------------


def test_the_model_id_is_the_model_argument_as_given():
    assert serve.served_model_names(serve.parse_args(["./models/my-llama"])) == ["./models/my-llama"]
    assert serve.served_model_names(serve.parse_args(["--model", "org/name"])) == ["org/name"]
    assert serve.served_model_names(serve.parse_args(["./m", "--served-model-name", "x"])) == ["x"]
    assert serve.served_model_names(serve.parse_args(["./m", "--served-model-name", "x", "y"])) == ["x", "y"]
    assert serve.served_model_names(serve.parse_args([])) == [MODEL_NAME]
    with pytest.raises(SystemExit):
        serve.parse_args(["./a", "--model", "./b"])


@pytest.fixture
def checkpoint_with_defaults(tmp_path: Path) -> Path:
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_config_defaults_are_read_as_vllm_reads_them(checkpoint_with_defaults, tmp_path_factory):
    applied, pending = generation_config_defaults(checkpoint_with_defaults)
    assert {**applied, **pending} == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 3}
    assert generation_config_defaults(tmp_path_factory.mktemp("none")) == ({}, {})


def test_generation_config_defaults_fill_what_a_request_leaves_unset(engine, checkpoint_with_defaults, caplog):
    args = serve.parse_args([str(checkpoint_with_defaults)])
    with caplog.at_level(logging.INFO, logger="vllm_from_scratch.serve"):
        defaults = serve.sampling_defaults(args, str(checkpoint_with_defaults))
    assert "temperature" in caplog.text and "0.6" in caplog.text
    assert serve.sampling_defaults(serve.parse_args(["--generation-config", "vllm"]), "x") == {}
    override = ["--override-generation-config", '{"temperature": 0.5, "min_p": 0.1}']
    assert serve.sampling_defaults(serve.parse_args(["--generation-config", "vllm", *override]), "x") == {
        "temperature": 0.5,
        "min_p": 0.1,
    }
    checkpoint = str(checkpoint_with_defaults)
    merged = serve.sampling_defaults(serve.parse_args([checkpoint, *override]), checkpoint)
    assert merged == {**defaults, "temperature": 0.5, "min_p": 0.1}  # vLLM's rule: the override wins
    with TestClient(build_app(engine, MODEL, default_sampling_params=defaults)) as c:
        c.post("/v1/completions", json={"prompt": [10], "max_tokens": None, "request_id": "a"})
        c.post("/v1/completions", json={"prompt": [10], "temperature": 0, "max_tokens": 8, "request_id": "b"})
        c.post("/v1/completions", json={"prompt": [10], "max_tokens": 2, "request_id": "c"})
    a, b, c_ = (engine.params[f"cmpl-{r}-0"] for r in "abc")
    assert (a.temperature, a.top_p, a.top_k, a.max_tokens) == (0.6, 0.9, 20, 3)
    assert (b.temperature, b.max_tokens) == (0, 3), "the request's own value wins; max_new_tokens caps"
    assert c_.max_tokens == 2


# ---- vLLM's request-timing metric families --------------------------------------------------------


def test_vllm_request_metric_families_after_a_request(client):
    client.post("/v1/completions", json={"prompt": [10, 11, 12], "max_tokens": 4})
    text = client.get("/metrics").text
    label = f'engine="0",model_name="{MODEL}"'
    for name in (
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:iteration_tokens_total",
        "vllm:request_params_max_tokens",
    ):
        assert f"# TYPE {name} histogram" in text, name
        assert f"{name}_count{{{label}}} " in text, name
    assert f"vllm:request_prompt_tokens_sum{{{label}}} 3.0" in text
    assert f"vllm:request_generation_tokens_sum{{{label}}} 4.0" in text
    assert f"vllm:request_params_max_tokens_sum{{{label}}} 4.0" in text
    assert f"vllm:request_inference_time_seconds_count{{{label}}} 1.0" in text
    iteration = re.search(rf"^vllm:iteration_tokens_total_sum{{{re.escape(label)}}} (\S+)$", text, re.M)
    assert iteration and float(iteration.group(1)) == 3 + 4
    assert "# TYPE vllm:request_success_total counter" in text


def test_bad_words_and_allowed_token_ids_reach_the_engine_checked(client, engine):
    for body, field in (({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words")):
        assert_error(client.post("/v1/completions", json={"prompt": "hi", **body}), 400, field)
    engine.params.clear()
    resp = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "bad_words": ["Paris"]})
    assert resp.status_code == 200, resp.text
    [params] = engine.params.values()
    assert params.bad_words == ["Paris"] and params.bad_words_token_ids, "tokenized by the server's input processor"
