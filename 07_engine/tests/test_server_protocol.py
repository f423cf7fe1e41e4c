"""The server's own logic against a scripted engine: request validation, SSE framing, usage,
metrics rendering, aborts and a dead engine loop. Fast and in-process (FastAPI's TestClient).

The real engine and the official openai client are exercised in ``test_server.py``; here a
``ScriptedEngine`` with ``LLMEngine``'s streaming contract makes every output predictable, so
each assertion checks an exact value.
"""

import asyncio
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from transformers import AutoTokenizer

from vllm_from_scratch import serve
from vllm_from_scratch.api_server import build_app, default_max_request_bytes
from vllm_from_scratch.async_llm import AsyncLLM, build_engine
from vllm_from_scratch.default_model import default_model_dir
from vllm_from_scratch.input_processor import EngineCoreRequest, InputProcessor
from vllm_from_scratch.metrics import EngineMetrics
from vllm_from_scratch.openai_protocol import APIError, CompletionRequest
from vllm_from_scratch.outputs import CompletionOutput, RequestOutput
from vllm_from_scratch.sampling_params import RequestOutputKind
from vllm_from_scratch.streaming import stream_events

MODEL = "scripted"
CRASH_TOKEN = 7  # a prompt containing this token id makes step() raise
ERROR_TOKEN = 9  # a prompt containing this token id ends its request with finish reason "error"
KEY = "a-class-key"
JSON = {"content-type": "application/json"}


class ScriptedEngine:
    """Echoes each prompt's token ids back, one per step, until ``max_tokens``. With ``n`` > 1,
    completion ``k`` starts ``k`` tokens into the prompt, and its outputs carry its ``index``
    under the request's id, as ``LLMEngine`` reports a parent's children. Records follow the
    request's ``output_kind`` (the server asks for deltas). Like ``LLMEngine`` it reports each
    completion's life to the metrics the server attaches (completion ``k`` is core request
    ``"k/id"``; every step schedules every completion still running)."""

    max_model_len = 64
    vocab_size = 49152
    config = SimpleNamespace(
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        max_n_sequences=256,
        speculative=None,
        kv_transfer=None,
        scheduling_policy="priority",
    )
    tracer = None  # as an engine without step_trace: /viz adds its own tracer
    stat_logger = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # The engine's own checks, so the server's error mapping is tested against the real rules.
        self.input_processor = InputProcessor(self.config, tokenizer, [])
        self.requests = {}
        self.aborted = []
        self.priorities = {}
        self.params = {}  # every request's SamplingParams, kept after it finishes
        self.stats = dict(
            prompt_tokens_total=0,
            generation_tokens_total=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions_total=0,
        )
        self.step_delay = 0.0

    def add_request(self, prompt, params=None, request_id=None, priority=0, fit_max_tokens=True):
        request = prompt
        if not isinstance(request, EngineCoreRequest):
            request = self.input_processor.process_inputs(request_id, prompt, params, priority, fit_max_tokens)
        rid, params = request.request_id, request.sampling_params
        prompt = request.prompt_token_ids
        outs = [[] for _ in range(params.n)]
        self.requests[rid] = dict(prompt=prompt, params=params, max_tokens=request.max_tokens, outs=outs)
        self.priorities[rid] = request.priority
        self.params[rid] = params
        self.stats["prompt_tokens_total"] += len(prompt)
        if self.stat_logger is not None:
            for k in range(params.n):
                self.stat_logger.request_added(
                    f"{k}/{rid}", request.arrival_time, len(prompt), request.max_tokens, rid, params.n
                )
        return rid

    def attach_metrics(self, model_name, get_stats=None, registry=None):
        self.stat_logger = EngineMetrics(model_name, get_stats or self.get_stats, self.max_model_len, registry=registry)
        return self.stat_logger

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        r = self.requests.pop(request_id, None)
        if r is not None and self.stat_logger is not None:
            for k in range(len(r["outs"])):
                self.stat_logger.request_finished(f"{k}/{request_id}", "abort", time.time())

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(self.step_delay)
        outputs = []
        for rid, r in list(self.requests.items()):
            if CRASH_TOKEN in r["prompt"]:
                raise RuntimeError("scripted crash")
            for k, out in enumerate(r["outs"]):
                if len(out) < r["max_tokens"]:
                    outputs.append(self._next_output(rid, r, k, out))
            if all(len(out) >= r["max_tokens"] for out in r["outs"]):
                del self.requests[rid]
        if self.stat_logger is not None:
            self._report(outputs)
        return self.mark_finished(outputs)

    def _report(self, outputs):
        now = time.monotonic()
        cores = [(f"{c.index}/{out.request_id}", c) for out in outputs for c in out.outputs]
        for core, _ in cores:
            self.stat_logger.request_scheduled(core, 0, now)
        self.stat_logger.step_tokens([(core, 1, 0) for core, _ in cores], now, time.time())
        for core, completion in cores:
            if completion.finish_reason is not None:
                self.stat_logger.request_finished(core, completion.finish_reason, time.time())

    def mark_finished(self, outputs):
        """A request's ``finished`` on its last record, once every completion has ended."""
        last = {out.request_id: out for out in outputs}
        for out in outputs:
            out.finished = out is last[out.request_id] and out.request_id not in self.requests
        return outputs

    def _next_output(self, rid, r, k, out):
        tok = r["prompt"][(len(out) + k) % len(r["prompt"])]
        out.append(tok)
        self.stats["generation_tokens_total"] += 1
        if ERROR_TOKEN in r["prompt"] and len(out) == 2:  # as LLMEngine ends a request it cannot go on with
            r["outs"][k] = [tok] * r["max_tokens"]
            return self._record(rid, r, CompletionOutput(k, "", [], finish_reason="error", error="why"))
        done = len(out) >= r["max_tokens"]
        reason = "length" if done else None
        if r["params"].output_kind == RequestOutputKind.DELTA:
            completion = CompletionOutput(k, self.tokenizer.decode([tok]), [tok], finish_reason=reason)
        else:
            text = "".join(self.tokenizer.decode([t]) for t in out)
            completion = CompletionOutput(k, text, list(out), finish_reason=reason)
        return self._record(rid, r, completion)

    @staticmethod
    def _record(rid, r, completion):
        return RequestOutput(rid, None, r["prompt"], outputs=[completion], num_cached_tokens=0)

    def get_stats(self):
        return dict(
            self.stats,
            num_requests_running=len(self.requests),
            num_requests_waiting=0,
            kv_cache_usage=0.25 if self.requests else 0.0,
        )


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
    return [e[len("data: ") :] for e in events]


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
    assert body["choices"] == [
        {"index": 0, "text": expected, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 8


def test_priority_in_the_body_reaches_the_engine(client, engine):
    for path, body in (
        ("/v1/completions", {"prompt": [10, 11]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        resp = client.post(path, json={"model": MODEL, "max_tokens": 2, "priority": -3, **body})
        assert resp.status_code == 200, resp.text
    assert list(engine.priorities.values()) == [-3, -3]


def test_stream_chunks_concatenate_and_end_with_done(client):
    req = {"model": MODEL, "prompt": "Hello there, friend", "max_tokens": 6}
    whole = client.post("/v1/completions", json=req).json()
    raw = client.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
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
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
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


@pytest.mark.parametrize(
    "payload, status, param",
    [
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "length_penalty": 0.5}, 400, "length_penalty"),
        ({"prompt": "hi", "suffix": "!"}, 400, "suffix"),
        ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ({"prompt": "hi", "prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
        # Out of range: refused by SamplingParams where it has penalties, else as unsupported.
        ({"prompt": "hi", "presence_penalty": 5.0}, 400, "presence_penalty"),
        ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0.0}, 400, "top_p"),
        ({"prompt": "hi", "top_k": -7}, 400, "top_k"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": [1, 2, 10**6]}, 400, "prompt"),
        ({"prompt": list(range(10, 80))}, 400, "prompt"),
        ({"prompt": list(range(10, 60)), "max_tokens": 30}, 400, "max_tokens"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ({"max_tokens": 3}, 400, "prompt"),
        # n is SamplingParams' to judge (its one rule), named in the 400 all the same.
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "n": -1}, 400, "n"),
        ({"prompt": "hi", "n": 1.5}, 400, "n"),
        ({"prompt": "hi", "n": True}, 400, "n"),
        ({"prompt": "hi", "n": "2"}, 400, "n"),
    ],
)
def test_bad_completion_requests_get_openai_errors(client, payload, status, param):
    assert_error(client.post("/v1/completions", json=payload), status, param)
    ok = client.post("/v1/completions", json={"prompt": [10], "max_tokens": 1})
    assert ok.status_code == 200, "the server keeps serving after a bad request"


def test_completion_checks_include_the_shared_sampling_checks():
    for field, value in [("length_penalty", 0.5), ("use_beam_search", True), ("guided_regex", "a+")]:
        with pytest.raises(APIError) as refused:
            CompletionRequest(prompt="hi", **{field: value}).check_supported()
        assert refused.value.param == field, (
            f"a completion request with {field}={value!r} must be refused by the shared sampling checks "
            "(_SamplingFields.check_supported(self)) before the completion fields"
        )


def test_error_codes_follow_openai(client):
    assert_error(
        client.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404, "model", code="model_not_found"
    )
    assert_error(
        client.post("/v1/completions", json={"prompt": list(range(10, 80))}),
        400,
        "prompt",
        code="context_length_exceeded",
    )


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x " * 80}]}, "messages"),
    ],
)
def test_bad_chat_requests_get_openai_errors(client, payload, param):
    assert_error(client.post("/v1/chat/completions", json=payload), 400, param)


def test_invalid_json_is_a_400_not_a_crash(client):
    resp = client.post("/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    err = assert_error(resp, 400)
    assert "JSON" in err["message"]
    assert_error(
        client.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400
    )
    assert client.get("/health").status_code == 200


def test_unknown_route_gets_an_error_body(client):
    assert_error(client.get("/v1/nothing"), 404)


def test_metrics_use_vllm_names_and_count_requests(client, engine):
    client.post("/v1/completions", json={"prompt": [10, 11], "max_tokens": 3})
    text = client.get("/metrics").text
    label = f'{{engine="0",model_name="{MODEL}"}}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text
        assert f"{name}{label} 0.0" in text
    assert f"vllm:prompt_tokens_total{label} 2.0" in text
    assert f"vllm:generation_tokens_total{label} 3.0" in text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert f"{name}{label} 0.0" in text
    assert f"vllm:time_to_first_token_seconds_count{label} 1.0" in text
    assert f"vllm:inter_token_latency_seconds_count{label} 2.0" in text
    assert f"vllm:e2e_request_latency_seconds_count{label} 1.0" in text
    assert f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 1.0' in text


def test_two_apps_have_separate_registries(tokenizer):
    with (
        TestClient(build_app(ScriptedEngine(tokenizer), "a")) as a,
        TestClient(build_app(ScriptedEngine(tokenizer), "b")) as b,
    ):
        a.post("/v1/completions", json={"prompt": [10], "max_tokens": 2})
        assert 'vllm:generation_tokens_total{engine="0",model_name="a"} 2.0' in a.get("/metrics").text
        assert 'vllm:generation_tokens_total{engine="0",model_name="b"} 0.0' in b.get("/metrics").text


def test_a_client_that_has_its_tokens_finds_them_in_the_metrics(tokenizer, monkeypatch):
    """The engine thread takes its stats snapshot, which /metrics reads, before it hands a step's
    outputs to their clients: every output goes out with the snapshot of the step that made it."""
    seen = []
    dispatch = AsyncLLM._dispatch

    def checked(self, outputs):
        if outputs:
            seen.append((self.stats["generation_tokens_total"], self.engine.get_stats()["generation_tokens_total"]))
        dispatch(self, outputs)

    monkeypatch.setattr(AsyncLLM, "_dispatch", checked)
    with TestClient(build_app(ScriptedEngine(tokenizer), "a")) as a:
        for max_tokens, total in ((1, 1), (3, 4)):
            a.post("/v1/completions", json={"prompt": [10], "max_tokens": max_tokens})
            assert f'vllm:generation_tokens_total{{engine="0",model_name="a"}} {total:.1f}' in a.get("/metrics").text
    assert seen and all(snapshot == engine for snapshot, engine in seen), seen
    assert seen[-1] == (4, 4)


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
                async for event in stream_events([stream], lambda i, out: out.outputs[0].text):
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
            return [out.outputs[0].token_ids async for out in stream]
        finally:
            llm.shutdown()

    assert asyncio.run(scenario()) == [[10], [10, 10]], "the default output kind: everything so far"


def test_build_engine_builds_in_a_thread_that_has_ended():
    builders = []

    def factory():
        builders.append(threading.current_thread())
        return "engine"

    assert build_engine(factory) == "engine"
    assert builders[0] is not threading.current_thread() and not builders[0].is_alive()

    def broken():
        raise ValueError("max_num_seqs must be >= 1")

    with pytest.raises(ValueError, match="max_num_seqs"):
        build_engine(broken)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or torch.get_num_threads() < 2, reason="counts OpenMP workers on Linux"
)
def test_build_engine_leaves_no_openmp_workers_behind():
    """The building thread's OpenMP pool ends with it: every thread that the build started (the
    building thread and its pool's workers) is gone soon after. Threads are compared by id, since
    other tests' threads may come and go; the workers exit asynchronously, hence the short wait."""
    before = set(os.listdir("/proc/self/task"))
    during: set[str] = set()

    def factory():
        product = torch.ones(512, 512) @ torch.ones(512, 512)
        during.update(os.listdir("/proc/self/task"))
        return product

    product = build_engine(factory)
    assert product[0, 0] == 512
    started = during - before
    assert len(started) >= 2, "the build should have run on its own thread with at least one OpenMP worker"
    deadline = time.monotonic() + 10.0
    while started & set(os.listdir("/proc/self/task")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started & set(os.listdir("/proc/self/task")), "a thread of the build outlived it"


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


# ---- a server a class can share: the API key ------------------------------------------------


@pytest.fixture
def keyed(engine):
    with TestClient(build_app(engine, MODEL, api_key=KEY)) as c:
        yield c


def test_api_key_guards_every_path_but_health_and_metrics(keyed):
    for path in ("/v1/models", "/v1/nothing", "/viz", "/viz/events", "/docs", "/openapi.json", "/health/"):
        resp = keyed.get(path, headers={"Authorization": "Bearer guess"})
        err = assert_error(resp, 401, code="invalid_api_key")
        assert err == {
            "message": "Unauthorized",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        assert resp.headers["www-authenticate"] == "Bearer"
        assert "guess" not in resp.text
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer ", f"Bearer  {KEY}"],
)
def test_a_missing_or_wrong_key_is_refused(keyed, engine, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    resp = keyed.post("/v1/completions", json={"prompt": [10], "max_tokens": 1}, headers=headers)
    assert_error(resp, 401, code="invalid_api_key")
    assert not engine.priorities, "nothing reached the engine"


def test_the_right_key_is_served(keyed):
    for scheme in ("Bearer", "bearer"):
        resp = keyed.post(
            "/v1/completions", json={"prompt": [10], "max_tokens": 1}, headers={"Authorization": f"{scheme} {KEY}"}
        )
        assert resp.status_code == 200, resp.text


def test_the_key_is_checked_before_the_body_is_read(engine):
    with TestClient(build_app(engine, MODEL, api_key=KEY, max_request_bytes=100)) as c:
        assert_error(c.post("/v1/completions", content=b"x" * 1000, headers=JSON), 401)
        assert_error(
            c.post("/v1/completions", content=b"x" * 1000, headers={**JSON, "Authorization": f"Bearer {KEY}"}), 413
        )


def test_websockets_need_the_key_too(keyed):
    with pytest.raises(WebSocketDisconnect) as info:
        with keyed.websocket_connect("/v1/anything"):
            pass
    assert info.value.code == 1008


def test_serve_takes_the_key_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert serve.resolve_api_keys(serve.parse_args([])) == []
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert serve.resolve_api_keys(serve.parse_args([])) == []
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert serve.resolve_api_keys(serve.parse_args([])) == ["from-env"]
    assert serve.resolve_api_keys(serve.parse_args(["--api-key", "from-flag"])) == ["from-flag"]
    assert serve.resolve_api_keys(serve.parse_args(["--api-key", "a", "b"])) == ["a", "b"]  # vLLM: the flag wins
    with pytest.raises(SystemExit):
        serve.parse_args(["--api-key", ""])  # "$KEY" of an unset variable must not open the server
    with pytest.raises(SystemExit):
        serve.parse_args(["--max-request-bytes", "0"])
    assert serve.parse_args(["--max-request-bytes", "4096"]).max_request_bytes == 4096


def test_several_names_and_keys_are_served_as_vllm_serves_them(engine, caplog):
    # `--served-model-name scripted alias --api-key k1 k2`: both names listed and accepted, the
    # first in responses; either key opens the server; behind a proxy's --root-path too.
    app = build_app(engine, [MODEL, "alias"], api_key=["k1", "k2"], root_path="/proxy", log_requests=True)
    with TestClient(app) as c, caplog.at_level("INFO", logger="vllm_from_scratch.serving"):
        for prefix in ("", "/proxy"):
            models = c.get(prefix + "/v1/models", headers={"Authorization": "Bearer k2"}).json()["data"]
            assert [m["id"] for m in models] == [MODEL, "alias"]
            assert c.get(prefix + "/health").status_code == 200
        for key, name in (("k1", "alias"), ("k2", MODEL), ("k2", None)):
            body = {"prompt": [10], "max_tokens": 1, **({"model": name} if name else {})}
            resp = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == MODEL
        assert_error(c.post("/v1/completions", json={"prompt": [10]}, headers={"Authorization": "Bearer k3"}), 401)
        unknown = {"model": "other", "prompt": [10]}
        assert_error(c.post("/v1/completions", json=unknown, headers={"Authorization": "Bearer k1"}), 404, "model")
    assert caplog.text.count("Received request cmpl-") == 3  # --enable-log-requests


def test_the_stats_line_reports_what_moved(caplog, monkeypatch):
    from vllm_from_scratch.api_server import log_stats_forever

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.05")
    llm = SimpleNamespace(stats={"prompt_tokens_total": 0, "generation_tokens_total": 0})

    async def run() -> None:
        task = asyncio.create_task(log_stats_forever(llm, "m"))
        await asyncio.sleep(0.08)
        llm.stats = {"prompt_tokens_total": 10, "generation_tokens_total": 4, "num_requests_running": 2}
        await asyncio.sleep(0.05)
        llm.stats = {"prompt_tokens_total": 10, "generation_tokens_total": 4, "num_requests_running": 0}
        await asyncio.sleep(0.15)
        task.cancel()

    with caplog.at_level("INFO", logger="vllm_from_scratch.api_server"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    assert lines, "a line for the interval in which the engine worked"
    assert all("Running: 2 reqs" in line for line in lines), "none for the idle intervals before and after"


def test_loopback_hosts():
    assert all(serve.is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.1.2.3"))
    assert not any(serve.is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.10", "example.org"))


# ---- one client cannot stall the others: the size limit, cheap refusals, work off the loop -----


def test_default_limit_fits_the_longest_prompt_the_vocabulary_can_write(tokenizer):
    """The bound's justification: max_model_len tokens of the longest vocabulary entry, as a
    JSON string, fit the default limit (with room for the rest of the body)."""
    longest = max(len(json.dumps(tokenizer.decode([i]))) - 2 for i in range(len(tokenizer)))
    assert longest == 82
    assert longest * 4096 + 1024 < default_max_request_bytes(4096) == 576 * 1024


def test_oversize_bodies_get_a_413_before_they_are_parsed(engine):
    big = json.dumps({"prompt": "x" * 2000}).encode()
    with TestClient(build_app(engine, MODEL, max_request_bytes=1000)) as c:
        err = assert_error(c.post("/v1/completions", content=big, headers=JSON), 413)
        assert "1000 bytes" in err["message"] and err["type"] == "invalid_request_error"
        chunked = c.post("/v1/completions", content=iter([big[:600], big[600:]]), headers=JSON)
        assert "content-length" not in chunked.request.headers
        assert_error(chunked, 413)
        assert_error(c.post("/v1/completions", content=b"NaN" + b" " * 2000, headers=JSON), 413)
        small = json.dumps({"prompt": [10, 11], "max_tokens": 2}).encode()
        resp = c.post("/v1/completions", content=iter([small[:7], small[7:]]), headers=JSON)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
        assert c.get("/health").status_code == 200
    assert len(engine.priorities) == 1, "only the request under the limit reached the engine"


def test_default_limit_follows_max_model_len(client):
    limit = default_max_request_bytes(ScriptedEngine.max_model_len)
    body = json.dumps({"prompt": "x" * limit}).encode()
    assert_error(client.post("/v1/completions", content=body, headers=JSON), 413)
    body = json.dumps({"prompt": "x " * (limit // 2 - 100)}).encode()
    assert_error(
        client.post("/v1/completions", content=body, headers=JSON), 400, "prompt", code="context_length_exceeded"
    )


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"prompt": "hi", "seed": 123456789012345678901234567890}', "seed"),
        (b'{"prompt": "hi", "seed": -9223372036854775809}', "seed"),
        (b'{"prompt": "hi", "seed": 1e30}', "seed"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "temperature": -Infinity}', "temperature"),
        (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
        (b'{"prompt": "hi", "top_p": NaN}', "top_p"),
        (b'{"prompt": "hi", "priority": 9223372036854775808}', "priority"),
        (b'{"prompt": "hi", "priority": -9223372036854775809}', "priority"),
        (b'{"prompt": "hi", "priority": "first"}', "priority"),
        (b'{"prompt": "hi", "max_tokens": 100000000000000000000}', "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 1.5}', "max_tokens"),
        (b'{"prompt": "hi", "top_k": -5}', "top_k"),
        (b'{"prompt": "hi", "stop_token_ids": [18446744073709551616]}', "stop_token_ids"),
        (b'{"prompt": [1, 2, 99999999999999999999999999]}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000000000000000000}',
            "max_completion_tokens",
        ),
    ],
)
def test_every_bad_value_names_its_parameter(client, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    err = assert_error(client.post(path, content=raw, headers=JSON), 400, param)
    assert len(err["message"]) < 300
    assert client.post("/v1/completions", json={"prompt": [10], "max_tokens": 1}).status_code == 200


def test_undecodable_bodies_get_a_400_saying_why(client):
    for raw in (
        b'{"prompt": "\xff\xfe"}',
        b"[" * 20000 + b"]" * 20000,
        b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}",
    ):
        err = assert_error(client.post("/v1/completions", content=raw, headers=JSON), 400)
        assert err["message"].startswith("Invalid JSON body"), err
    assert client.get("/health").status_code == 200


def test_a_long_list_of_bad_items_costs_one_short_error(client):
    start = time.perf_counter()
    resp = client.post("/v1/completions", content=json.dumps({"prompt": [1.5] * 12000}).encode(), headers=JSON)
    assert time.perf_counter() - start < 1.0
    err = assert_error(resp, 400, "prompt")
    assert len(resp.content) < 1000 and err["message"].endswith("and 1 more")


def test_bodies_are_prepared_in_low_priority_worker_threads(client, tokenizer, monkeypatch):
    seen = []

    def spy(method):
        def wrapper(*args, **kwargs):
            seen.append((method.__name__, threading.current_thread().name))
            return method(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(tokenizer, "encode", spy(tokenizer.encode))
    monkeypatch.setattr(tokenizer, "apply_chat_template", spy(tokenizer.apply_chat_template))
    assert client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1}).status_code == 200
    assert (
        client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        ).status_code
        == 200
    )
    assert {name for name, _ in seen} == {"encode", "apply_chat_template"}
    assert all(thread.startswith("prepare") for _, thread in seen), seen
    if sys.platform == "linux":
        nice = client.app.state.serving.executor.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        ).result()
        assert nice == 19


def test_a_prompt_over_the_context_never_reaches_the_engine_thread(client, engine):
    resp = client.post("/v1/completions", json={"prompt": list(range(10, 80))})
    assert_error(resp, 400, "prompt", code="context_length_exceeded")
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 80}]})
    assert_error(resp, 400, "messages", code="context_length_exceeded")
    assert not engine.priorities


def _params(max_tokens):
    from vllm_from_scratch.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens)
