"""What one request may ask of a shared server, and how every failure reaches its client: the
limits (each a 400 naming the field and the limit, before any work), text that is not Unicode
(a 400 naming the field), a request the engine ends with an error (vLLM's 500, or an error
event in a stream), and a bug (a JSON 500, never plain text). Against the scripted engine of
``test_server_protocol.py``, in-process.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

import test_server_protocol
from test_server_protocol import ERROR_TOKEN, MODEL, ScriptedEngine
from vllm_from_scratch.api_server import build_app
from vllm_from_scratch.config import SERVING_CPU_PROMPT_CHUNK, SERVING_CPU_TOKEN_BUDGET, EngineConfig, ServingLimits
from vllm_from_scratch.serving import OpenAIServing

HI = [{"role": "user", "content": "hi"}]
LIMITS = ServingLimits(
    max_completion_prompts=3, max_stop_strings=2, max_response_logprobs=1000, max_request_kv_tokens=150
)
tokenizer = test_server_protocol.tokenizer


@pytest.fixture
def engine(tokenizer):
    return ScriptedEngine(tokenizer)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, MODEL, limits=LIMITS)) as c:
        yield c


def refused(response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


def test_too_many_prompts_stop_strings_or_logprobs_are_refused_before_any_work(client, engine):
    refused(client.post("/v1/completions", json={"prompt": ["a"] * 4}), "prompt", "at most 3", "max_completion_prompts")
    refused(client.post("/v1/completions", json={"prompt": "a", "stop": ["x", "y", "z"]}), "stop", "max_stop_strings")
    # 2 choices x 10 tokens x (1 + 20 logprobs) = 420 fits in 1000; 5 choices (1,050) do not.
    assert client.post("/v1/completions", json={"prompt": [5, 6], "n": 2, "max_tokens": 10, "logprobs": 20}).is_success
    refused(
        client.post("/v1/completions", json={"prompt": [5, 6], "n": 5, "max_tokens": 10, "logprobs": 20}),
        "logprobs",
        "1,050",
        "max_response_logprobs",
    )
    # The echoed prompt and prompt_logprobs count on every choice: 3 x 40 x 21 twice, + 3 x 21.
    body = {"prompt": list(range(10, 50)), "n": 3, "max_tokens": 1, "echo": True, "logprobs": 20}
    refused(client.post("/v1/completions", json=body), "echo", "5,103")
    # Chat without max_tokens may fill the context: 2 x (64 - 31) x 21 = 1,386.
    body = {"messages": HI, "n": 2, "logprobs": True, "top_logprobs": 20}
    refused(client.post("/v1/chat/completions", json=body), "top_logprobs", "1,386")
    assert list(engine.params) == [next(iter(engine.params))], "a refused request reached the engine"


def test_a_request_that_could_hold_too_much_kv_cache_is_refused_naming_n_or_max_tokens(client, engine):
    # Each sequence may hold its prompt and max_tokens: 2 x (2 + 60) = 124 fits in 150.
    assert client.post("/v1/completions", json={"prompt": [5, 6], "n": 2, "max_tokens": 60}).is_success
    refused(
        client.post("/v1/completions", json={"prompt": [5, 6], "n": 3, "max_tokens": 60}),
        "n",
        "186",
        "max_request_kv_tokens",
    )
    # One completion of each of three prompts: the prompts add up, and max_tokens is to blame.
    body = {"prompt": [[5, 6]] * 3, "max_tokens": 60}
    refused(client.post("/v1/completions", json=body), "max_tokens", "186", "3 prompt(s)")
    # Chat without max_tokens may fill the context (64): 3 x 64 = 192.
    refused(client.post("/v1/chat/completions", json={"messages": HI, "n": 3}), "n", "192", "until the context is full")
    body = {"messages": HI, "n": 3, "max_completion_tokens": 10}
    assert client.post("/v1/chat/completions", json=body).is_success
    assert all(p.n < 3 or p.max_tokens == 10 for p in engine.params.values()), "a refused request reached the engine"


def test_the_server_on_a_cpu_takes_prompts_in_small_chunks(tiny_llama_dir):
    # A step carrying a prompt chunk holds up every decoding stream on a CPU, so one prompt takes
    # a small chunk of the server's default budget; offline work keeps vLLM's 2048 and no cap,
    # and a given budget or cap is kept.
    served = EngineConfig(tiny_llama_dir, device="cpu", serving=True)
    assert served.max_num_batched_tokens == SERVING_CPU_TOKEN_BUDGET
    assert served.long_prefill_token_threshold == SERVING_CPU_PROMPT_CHUNK < SERVING_CPU_TOKEN_BUDGET
    offline = EngineConfig(tiny_llama_dir, device="cpu")
    assert (offline.max_num_batched_tokens, offline.long_prefill_token_threshold) == (2048, None)
    config = EngineConfig(tiny_llama_dir, device="cpu", serving=True, max_num_batched_tokens=1024)
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (1024, None)
    config = EngineConfig(tiny_llama_dir, device="cpu", serving=True, long_prefill_token_threshold=64)
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (SERVING_CPU_TOKEN_BUDGET, 64)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    serving=st.booleans(),
    chunked=st.booleans(),
    budget=st.one_of(st.none(), st.integers(4096, 16384)),
    threshold=st.one_of(st.none(), st.integers(1, 4096)),
)
def test_the_per_prompt_cap_fills_in_only_for_the_servers_own_budget(
    tiny_llama_dir, serving, chunked, budget, threshold
):
    """Over every combination: the cap of 128 a prompt comes only with the CPU server's default
    budget (chunked prefill on, no budget and no cap given); anything given is kept."""
    config = EngineConfig(
        tiny_llama_dir,
        device="cpu",
        serving=serving,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )
    server_default = serving and chunked and budget is None
    expected_threshold = SERVING_CPU_PROMPT_CHUNK if server_default and threshold is None else threshold
    assert config.long_prefill_token_threshold == expected_threshold
    if budget is not None:
        assert config.max_num_batched_tokens == budget
    elif server_default:
        assert config.max_num_batched_tokens == SERVING_CPU_TOKEN_BUDGET


def test_the_limits_are_flags_of_the_server():
    from vllm_from_scratch.serve import parse_args

    args = parse_args(["--max-response-logprobs", "7", "--max-stop-strings", "1", "--max-logprobs", "3"])
    limits = ServingLimits.from_cli_args(args)
    assert (limits.max_response_logprobs, limits.max_stop_strings, limits.max_logprobs) == (7, 1, 3)
    assert limits.max_completion_prompts == ServingLimits().max_completion_prompts
    with pytest.raises(ValueError, match="max_stop_strings"):
        ServingLimits(max_stop_strings=0)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud83d"]}', "stop"),
        ("/v1/completions", '{"prompt": "ok", "model": "\\ud800"}', "model"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\uDC00"}]}', "messages"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/v1/completions", '{"prompt": "ok", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(client, path, body, param):
    refused(client.post(path, content=body, headers={"content-type": "application/json"}), param, "surrogate")


def test_escaped_emoji_are_text(client):
    # A surrogate *pair*, as clients that escape non-ASCII send an emoji, is one character.
    response = client.post(
        "/tokenize", content='{"prompt": "\\ud83d\\ude00"}', headers={"content-type": "application/json"}
    )
    assert response.status_code == 200 and response.json()["count"] >= 1


def test_a_request_the_engine_ends_with_an_error_is_a_500(client, engine):
    response = client.post("/v1/completions", json={"prompt": [5, ERROR_TOKEN, 6], "max_tokens": 4})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "why" in error["message"]
    ok = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200, "one request's error must not touch the next"


def test_a_streamed_request_the_engine_ends_with_an_error_gets_an_error_event(client):
    body = {"prompt": [5, ERROR_TOKEN, 6], "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "why" in error["message"]


def test_a_bug_is_a_json_500(tokenizer, monkeypatch):
    def broken(self, body, request_id):
        raise KeyError("a bug")

    monkeypatch.setattr(OpenAIServing, "prepare", broken)
    with TestClient(build_app(ScriptedEngine(tokenizer), MODEL), raise_server_exceptions=False) as c:
        response = c.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert "a bug" in response.json()["error"]["message"]


def test_a_step_that_raises_costs_its_requests_and_the_server_goes_on(tiny_llama_dir, monkeypatch):
    from vllm_from_scratch.async_llm import MAX_FAILED_STEPS
    from vllm_from_scratch.engine import LLMEngine

    engine = LLMEngine(
        tiny_llama_dir, enforce_eager=True, num_kvcache_blocks=32, max_model_len=64, warm_up=False, dtype="float32"
    )
    runner = engine.executor.runner
    forward = runner.execute_model
    failing = {"steps": 1}

    def flaky(scheduler_output):
        if failing["steps"]:
            failing["steps"] -= 1
            raise RuntimeError("a kernel bug")
        return forward(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", flaky)
    body = {"prompt": [5, 6, 7], "max_tokens": 3}
    with TestClient(build_app(engine, MODEL)) as c:
        failed = c.post("/v1/completions", json=body)
        assert failed.status_code == 500 and "a kernel bug" in failed.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=body).status_code == 200
        assert engine.block_manager.all_blocks_free()
        # A fault that every step meets is no single request's: the engine is then taken for dead.
        failing["steps"] = MAX_FAILED_STEPS
        for _ in range(MAX_FAILED_STEPS):
            c.post("/v1/completions", json=body)
        assert c.get("/health").status_code == 503
