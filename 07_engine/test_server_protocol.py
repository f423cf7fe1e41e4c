"""The server's own logic against a scripted engine: request validation, SSE framing, usage,
metrics rendering, aborts and a dead engine loop. Fast and in-process (FastAPI's TestClient).

The real engine and the official openai client are exercised in ``test_server.py``; here a
``ScriptedEngine`` with ``LLMEngine``'s streaming contract makes every output predictable, so
each assertion checks an exact value.
"""

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from vllm_from_scratch.async_llm import AsyncLLM
from vllm_from_scratch.default_model import default_model_dir
from vllm_from_scratch.api_server import build_app
from vllm_from_scratch.engine import RequestOutput, encode_prompt, resolve_max_tokens
from vllm_from_scratch.streaming import stream_events

MODEL = "scripted"
CRASH_TOKEN = 7  # a prompt containing this token id makes step() raise


class ScriptedEngine:
    """Echoes each prompt's token ids back, one per step, until ``max_tokens``."""

    max_model_len = 64
    vocab_size = 49152

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests = {}
        self.aborted = []
        self.priorities = {}
        self.stats = dict(prompt_tokens_total=0, generation_tokens_total=0, prefix_cache_queries=0,
                          prefix_cache_hits=0, num_preemptions_total=0)
        self.step_delay = 0.0

    def add_request(self, prompt, params, request_id=None, priority=0, fit_max_tokens=True):
        # The engine's own checks, so the server's error mapping is tested against the real rules.
        prompt = encode_prompt(None, prompt, self.vocab_size, self.max_model_len)
        max_tokens = resolve_max_tokens(params.max_tokens, len(prompt), self.max_model_len, fit_max_tokens)
        self.requests[request_id] = dict(prompt=prompt, params=params, max_tokens=max_tokens, out=[])
        self.priorities[request_id] = priority
        self.stats["prompt_tokens_total"] += len(prompt)
        return request_id

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(self.step_delay)
        outputs = []
        for rid, r in list(self.requests.items()):
            if CRASH_TOKEN in r["prompt"]:
                raise RuntimeError("scripted crash")
            tok = r["prompt"][len(r["out"]) % len(r["prompt"])]
            r["out"].append(tok)
            self.stats["generation_tokens_total"] += 1
            piece = self.tokenizer.decode([tok])
            done = len(r["out"]) >= r["max_tokens"]
            if done:
                del self.requests[rid]
            outputs.append(RequestOutput(rid, [tok], list(r["out"]), piece,
                               "".join(self.tokenizer.decode([t]) for t in r["out"]), done,
                               "length" if done else None, len(r["prompt"]), 0))
        return outputs

    def get_stats(self):
        return dict(self.stats, num_requests_running=len(self.requests), num_requests_waiting=0,
                    kv_cache_usage=0.25 if self.requests else 0.0)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture
def engine(tokenizer):
    return ScriptedEngine(tokenizer)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, MODEL)) as c:
        yield c


def sse_events(raw: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_models_lists_the_served_model(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]
    assert data[0]["max_model_len"] == ScriptedEngine.max_model_len


def test_completion_returns_text_and_usage(client, tokenizer):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": [10, 11, 12], "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    expected = "".join(tokenizer.decode([t]) for t in [10, 11, 12, 10, 11])
    assert body["choices"] == [{"index": 0, "text": expected, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 8


def test_priority_in_the_body_reaches_the_engine(client, engine):
    for path, body in (("/v1/completions", {"prompt": [10, 11]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        resp = client.post(path, json={"model": MODEL, "max_tokens": 2, "priority": -3, **body})
        assert resp.status_code == 200, resp.text
    assert list(engine.priorities.values()) == [-3, -3]


def test_stream_chunks_concatenate_and_end_with_done(client):
    req = {"model": MODEL, "prompt": "Hello there, friend", "max_tokens": 6}
    whole = client.post("/v1/completions", json=req).json()
    raw = client.post("/v1/completions", json={**req, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]


def test_chat_stream_announces_role_then_content(client, tokenizer):
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    whole = client.post("/v1/chat/completions", json=req).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert whole["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
    events = sse_events(client.post("/v1/chat/completions", json={**req, "stream": True}).text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_batched_prompts_give_one_choice_each(client, tokenizer):
    body = client.post("/v1/completions", json={"prompt": [[20, 21], [30]], "max_tokens": 3}).json()
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == ["".join(tokenizer.decode([t]) for t in ids) for ids in ([20, 21, 20], [30, 30, 30])]
    assert body["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("payload, status, param", [
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "echo": True}, 400, "echo"),
    ({"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -7}, 400, "top_k"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ({"prompt": list(range(10, 80))}, 400, "prompt"),
    ({"prompt": list(range(10, 60)), "max_tokens": 30}, 400, "max_tokens"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_bad_completion_requests_get_openai_errors(client, payload, status, param):
    assert_error(client.post("/v1/completions", json=payload), status, param)
    ok = client.post("/v1/completions", json={"prompt": [10], "max_tokens": 1})
    assert ok.status_code == 200, "the server keeps serving after a bad request"


def test_error_codes_follow_openai(client):
    assert_error(client.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404, "model",
                 code="model_not_found")
    assert_error(client.post("/v1/completions", json={"prompt": list(range(10, 80))}), 400, "prompt",
                 code="context_length_exceeded")


@pytest.mark.parametrize("payload, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x " * 80}]}, "messages"),
])
def test_bad_chat_requests_get_openai_errors(client, payload, param):
    assert_error(client.post("/v1/chat/completions", json=payload), 400, param)


def test_invalid_json_is_a_400_not_a_crash(client):
    resp = client.post("/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    err = assert_error(resp, 400)
    assert "JSON" in err["message"]
    assert_error(client.post("/v1/chat/completions", content=b"[1, 2]",
                             headers={"content-type": "application/json"}), 400)
    assert client.get("/health").status_code == 200


def test_unknown_route_gets_an_error_body(client):
    assert_error(client.get("/v1/nothing"), 404)


def test_metrics_use_vllm_names_and_count_requests(client, engine):
    client.post("/v1/completions", json={"prompt": [10, 11], "max_tokens": 3})
    text = client.get("/metrics").text
    label = f'{{model_name="{MODEL}"}}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text
        assert f"{name}{label} 0.0" in text
    assert f"vllm:prompt_tokens_total{label} 2.0" in text
    assert f"vllm:generation_tokens_total{label} 3.0" in text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total"):
        assert f"{name}{label} 0.0" in text
    assert f"vllm:time_to_first_token_seconds_count{label} 1.0" in text
    assert f"vllm:inter_token_latency_seconds_count{label} 2.0" in text
    assert f"vllm:e2e_request_latency_seconds_count{label} 1.0" in text
    assert f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}} 1.0' in text


def test_two_apps_have_separate_registries(tokenizer):
    with TestClient(build_app(ScriptedEngine(tokenizer), "a")) as a, \
            TestClient(build_app(ScriptedEngine(tokenizer), "b")) as b:
        a.post("/v1/completions", json={"prompt": [10], "max_tokens": 2})
        assert 'vllm:generation_tokens_total{model_name="a"} 2.0' in a.get("/metrics").text
        assert 'vllm:generation_tokens_total{model_name="b"} 0.0' in b.get("/metrics").text


def test_dead_engine_loop_fails_requests_and_health(client):
    assert client.get("/health").status_code == 200
    resp = client.post("/v1/completions", json={"prompt": [CRASH_TOKEN], "max_tokens": 2})
    assert_error(resp, 503)
    health = client.get("/health")
    assert health.status_code == 503 and "scripted crash" in health.json()["error"]["message"]
    assert_error(client.post("/v1/completions", json={"prompt": [10], "max_tokens": 2}), 503)


def test_cancelled_stream_aborts_its_engine_request(engine):
    """The disconnect path: Starlette cancels the SSE generator; its request must be aborted."""
    engine.step_delay = 0.01

    async def scenario():
        llm = AsyncLLM(engine)
        llm.start()
        try:
            stream = await llm.add_request("r1", [10, 11], _params(max_tokens=60))
            received = []

            async def consume():
                async for event in stream_events([stream], lambda i, out: None, lambda i, t, f: t):
                    received.append(event)

            task = asyncio.ensure_future(consume())
            while not received:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
        finally:
            llm.shutdown()
        return llm

    llm = asyncio.run(scenario())
    assert engine.aborted == ["r1"]
    assert not engine.requests
    assert llm.stats["num_requests_running"] == 0


def test_engine_value_error_reaches_the_caller_and_loop_lives(engine):
    async def scenario():
        llm = AsyncLLM(engine)
        llm.start()
        try:
            with pytest.raises(ValueError, match="prompt"):
                await llm.add_request("bad", [], _params(max_tokens=2))
            stream = await llm.add_request("good", [10], _params(max_tokens=2))
            return [out.new_token_ids async for out in stream]
        finally:
            llm.shutdown()

    assert asyncio.run(scenario()) == [[10], [10]]


def test_many_concurrent_requests_share_the_loop(client):
    results = [None] * 24

    def call(i):
        results[i] = client.post("/v1/completions", json={"prompt": [100 + i], "max_tokens": 4}).json()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r["usage"]["completion_tokens"] == 4 for r in results)


def _params(max_tokens):
    from vllm_from_scratch.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens)

