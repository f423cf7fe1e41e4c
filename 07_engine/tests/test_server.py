"""The real server, end to end: a ``python -m vllm_from_scratch.serve`` process with the default
model (SmolLM2-135M-Instruct) on a free loopback port, driven by the official ``openai`` client.

One server is started for the whole module (a few seconds) and always stopped. Outputs are
kept short (a handful of tokens) so the module stays well under two minutes on a 2-core CPU.
"""

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_testing import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
MAX_MODEL_LEN = 512
KEY = "test-server-key"
ALIAS = "smol"  # a second --served-model-name
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def base_url():
    # The key through the environment, as a teacher would pass it (not in the process list).
    with ServerProcess(
        [
            "vllm_from_scratch.serve",
            "--max-num-seqs",
            "16",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--num-kvcache-blocks",
            "160",
            "--log-level",
            "warning",
            "--served-model-name",
            MODEL,
            ALIAS,
        ],
        startup_timeout_s=180,
        env={"VLLM_API_KEY": KEY},
    ) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metric(base_url: str, name: str, labels: str = f'engine="0",model_name="{MODEL}"') -> float:
    text = httpx.get(base_url + "/metrics").text
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert match, f"{name}{{{labels}}} missing from /metrics"
    return float(match.group(1))


def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]  # the names given, in order


def test_every_served_name_is_served(client):
    resp = client.completions.create(model=ALIAS, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert resp.model == MODEL  # responses carry the first name, as vLLM's do
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="x", max_tokens=1)


def test_chat_answers_paris(client):
    resp = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens > 5
    assert 0 < resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_with_extra_body_fields(client):
    resp = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "top_k": 5},
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    assert resp.choices[0].text.strip()


def test_chat_stream_concatenates_to_the_non_streamed_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CAPITAL,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completion_stream_concatenates_to_the_non_streamed_answer(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    text = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert text == whole.choices[0].text


def test_stop_string_ends_the_answer(client):
    resp = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12, stop=["Paris"])
    assert resp.choices[0].finish_reason == "stop"
    assert "Paris" not in resp.choices[0].message.content


def paris_token(base_url: str) -> int:
    tokens = httpx.post(base_url + "/tokenize", json={"prompt": " Paris", "add_special_tokens": False}, headers=AUTH)
    [paris] = tokens.json()["tokens"]
    return paris


def test_stop_token_ids_end_the_answer_and_name_the_token(client, base_url):
    paris = paris_token(base_url)
    resp = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12, extra_body={"stop_token_ids": [paris]}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == paris  # vLLM's field, beside OpenAI's
    stopped = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=12, stop=["Paris"]
    )
    assert stopped.choices[0].stop_reason == "Paris"


def test_a_stop_token_leaves_its_text_out(client, base_url):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=12,
        extra_body={"stop_token_ids": [paris_token(base_url)]},
    )
    assert "Paris" not in resp.choices[0].message.content


def test_an_unsupported_field_is_refused_by_name_on_the_real_server(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=3)
    assert info.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"temprature": 0.1})
    assert info.value.body["param"] == "temprature"


def test_dozens_of_concurrent_requests_are_all_answered(base_url):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        async with aclient:
            return await asyncio.gather(
                *[
                    aclient.completions.create(
                        model=MODEL,
                        prompt=f"Count to {i}:",
                        max_tokens=4,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(24)
                ]
            )

    results = asyncio.run(run())
    assert len(results) == 24
    assert all(r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length" for r in results)
    assert metric(base_url, "vllm:num_requests_running") == 0


def test_bad_inputs_get_4xx_and_the_server_keeps_serving(client, base_url):
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    cases = [
        (openai.BadRequestError, dict(prompt="hi", max_tokens=-1), "max_tokens"),
        (openai.BadRequestError, dict(prompt=long_prompt, max_tokens=4), "prompt"),
        (openai.BadRequestError, dict(prompt="hi", max_tokens=4, n=0), "n"),
        (openai.NotFoundError, dict(prompt="hi", max_tokens=4, model="gpt-4o"), "model"),
    ]
    for error, kwargs, param in cases:
        with pytest.raises(error) as info:
            client.completions.create(**{"model": MODEL, **kwargs})
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}])
    raw = httpx.post(
        base_url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json", **AUTH},
    )
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(base_url + "/health").status_code == 200
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def _assert_idle_soon(base_url: str) -> None:
    """Within 20 s, no request runs and the KV cache is empty: an abort returned every block."""
    deadline = time.time() + 20
    while time.time() < deadline and (
        metric(base_url, "vllm:num_requests_running") != 0 or metric(base_url, "vllm:kv_cache_usage_perc") != 0
    ):
        time.sleep(0.1)
    assert metric(base_url, "vllm:num_requests_running") == 0
    assert metric(base_url, "vllm:kv_cache_usage_perc") == 0


def test_disconnect_mid_stream_aborts_and_frees(base_url):
    aborted_before = _abort_count(base_url)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=AUTH) as http:
        with http.stream("POST", base_url + "/v1/completions", json=body) as resp:
            received = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    received.append(json.loads(line[6:]))
                if len(received) >= 3:
                    break
        assert metric(base_url, "vllm:generation_tokens_total") > 0
    _assert_idle_soon(base_url)
    assert _abort_count(base_url) == aborted_before + 1
    assert all(c["choices"][0]["finish_reason"] is None for c in received)


def test_client_timeout_on_a_non_streamed_request_aborts_it(base_url):
    aborted_before = _abort_count(base_url)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, timeout=1.5, headers=AUTH)
    _assert_idle_soon(base_url)
    assert _abort_count(base_url) == aborted_before + 1


def _abort_count(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    match = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    assert match, "vllm:request_success_total{finished_reason=abort} missing from /metrics"
    return float(match.group(1))


def test_metrics_after_traffic(client, base_url):
    for _ in range(2):  # the same prompt twice: the second reuses the first's full blocks
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "x " * 40}, *CAPITAL], temperature=0, max_tokens=2
        )
    assert metric(base_url, "vllm:prefix_cache_hits_total") > 0
    assert metric(base_url, "vllm:prefix_cache_queries_total") >= metric(base_url, "vllm:prefix_cache_hits_total")
    assert metric(base_url, "vllm:prompt_tokens_total") > 0
    assert metric(base_url, "vllm:num_preemptions_total") >= 0
    assert metric(base_url, "vllm:num_requests_waiting") == 0
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "vllm:request_params_max_tokens_count",
        "vllm:iteration_tokens_total_count",
    ):
        assert metric(base_url, name) > 0, name
    assert metric(base_url, "vllm:request_prefill_time_seconds_sum") > 0, "a prefill takes time on the real engine"


def test_load_generator_against_the_server(base_url):
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parents[1] / "benchmarks" / "load_generator.py"),
            "--base-url",
            base_url,
            "--num-requests",
            "6",
            "--request-rate",
            "inf",
            "--input-len",
            "16:32",
            "--output-len",
            "4",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENAI_API_KEY": KEY},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"Successful requests:\s+6\b", out.stdout), out.stdout
    assert re.search(r"Total generated tokens:\s+24\b", out.stdout), out.stdout


def test_the_key_guards_the_api_but_not_the_probes(base_url):
    stranger = openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        stranger.models.list()
    assert info.value.body == {
        "message": "Unauthorized",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(base_url + "/health").status_code == 200
    assert httpx.get(base_url + "/metrics").status_code == 200


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", b'{"prompt": "hi", "seed": 123456789012345678901234567890}', "seed"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            "temperature",
        ),
        ("/v1/completions", b'{"prompt": "hi", "priority": 9223372036854775808}', "priority"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000000000000000000}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "top_k": -5}', "top_k"),
    ],
)
def test_bad_values_name_their_parameter_on_the_real_engine(base_url, path, raw, param):
    resp = httpx.post(base_url + path, content=raw, headers={"content-type": "application/json", **AUTH})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_an_oversize_body_gets_a_413_and_the_server_keeps_serving(client):
    with pytest.raises(openai.APIStatusError) as info:  # the default limit for 512 tokens: 128 KiB
        client.completions.create(model=MODEL, prompt="x" * 200_000, max_tokens=2)
    assert info.value.status_code == 413
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_serve_help():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_from_scratch.serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert all(flag in out.stdout for flag in ("--max-num-seqs", "--api-key", "--max-request-bytes"))
