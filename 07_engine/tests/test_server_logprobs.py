"""The server's logprobs, ``echo`` and ``prompt_logprobs``, in vLLM's OpenAI shapes.

Against a scripted engine that reports made-up logprobs (every rendered value exact): the
completions lists and chat ``content``, streamed chunks, ``echo`` (with ``max_tokens: 0``),
``prompt_logprobs`` (on the choice for completions, beside the choices for chat),
``return_tokens_as_token_ids``, ``-inf`` sent as ``-9999.0``, and the 400s. Against the real
engine with the default model: lm-evaluation-harness's loglikelihood request scores a
continuation as transformers' log-softmax does, and chat logprobs equal transformers' too.
"""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

import test_server_protocol
from test_engine_default_model import SMALL_ENGINE
from test_logprobs import hf_logprobs
from test_server_protocol import MODEL, ScriptedEngine, assert_error, sse_events
from vllm_from_scratch.api_server import build_app
from vllm_from_scratch.default_model import default_model_dir
from vllm_from_scratch.engine import LLMEngine
from vllm_from_scratch.outputs import Logprob

INF_TOKEN = 13  # the scripted engine gives it logprob -inf
HELD_TOKEN = 14  # ... and no text, as a token held back for a possible stop string
TOP = [200, 201, 202, 203, 204]  # its "most likely" tokens, in rank order
HI = [{"role": "user", "content": "hi"}]
tokenizer = test_server_protocol.tokenizer


def made_up_logprob(token: int) -> float:
    return -math.inf if token == INF_TOKEN else -token / 100


def made_up_entry(token: int, k: int, decode) -> dict[int, Logprob]:
    """The engine's shape: the scored token first, then the top ``k`` (a top one scored is listed once)."""
    entry = {token: Logprob(made_up_logprob(token), 99, decode(token))}
    for rank, t in enumerate(TOP[:k], 1):
        entry[t] = Logprob(-rank / 10, rank, decode(t))
    return entry


class LogprobEngine(ScriptedEngine):
    """The scripted engine (each prompt's tokens echoed back), reporting made-up logprobs and
    prompt logprobs where the request's ``SamplingParams`` asks, as ``LLMEngine`` does."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.prompts: dict[str, list[int]] = {}

    def add_request(self, prompt, params=None, request_id=None, priority=0, fit_max_tokens=True):
        rid = super().add_request(prompt, params, request_id, priority, fit_max_tokens)
        self.prompts[rid] = self.requests[rid]["prompt"]
        return rid

    def step(self):
        outputs = super().step()
        decode = self.decode
        for out in outputs:
            params, prompt = self.params[out.request_id], self.prompts[out.request_id]
            (completion,) = out.outputs  # a delta: the server asks for them
            if HELD_TOKEN in completion.token_ids:
                completion.text = ""
            if params.logprobs is not None:
                completion.logprobs = [made_up_entry(t, params.logprobs, decode) for t in completion.token_ids]
            if params.prompt_logprobs is not None:
                out.prompt_logprobs = [None, *(made_up_entry(t, params.prompt_logprobs, decode) for t in prompt[1:])]
        return outputs

    def decode(self, token: int) -> str:
        return self.tokenizer.decode([token])


@pytest.fixture
def engine(tokenizer):
    return LogprobEngine(tokenizer)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, MODEL)) as c:
        yield c


def post(client, path: str, body: dict) -> dict:
    resp = client.post(path, json={"model": MODEL, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream_chunks(client, path: str, body: dict) -> list[dict]:
    events = sse_events(client.post(path, json={"model": MODEL, **body, "stream": True}).text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def offsets(tokens: list[str], start: int = 0) -> list[int]:
    """vLLM's text_offset rule: each token starts where the previous token string ended."""
    out = []
    for token in tokens:
        out.append(start)
        start += len(token)
    return out


def expected_top(token: int, k: int, decode) -> dict[str, float]:
    return {decode(t): max(lp.logprob, -9999.0) for t, lp in made_up_entry(token, k, decode).items()}


def concatenated(chunks: list[dict], key: str) -> list:
    return [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"][key]]


# ---- completions -----------------------------------------------------------------------------


def test_completion_logprobs_follow_vllms_rules(client, engine):
    body = post(client, "/v1/completions", {"prompt": [10, INF_TOKEN, 12], "max_tokens": 3, "logprobs": 2})
    [choice] = body["choices"]
    decode = engine.decode
    tokens = [decode(t) for t in (10, INF_TOKEN, 12)]
    assert choice["logprobs"] == {
        "text_offset": offsets(tokens),
        "token_logprobs": [-0.1, -9999.0, -0.12],  # -inf goes out as OpenAI's -9999.0
        "tokens": tokens,
        "top_logprobs": [expected_top(t, 2, decode) for t in (10, INF_TOKEN, 12)],
    }
    assert all(len(top) == 3 for top in choice["logprobs"]["top_logprobs"]), "the scored token and the top 2"
    assert "prompt_logprobs" not in choice
    [params] = engine.params.values()
    assert (params.logprobs, params.prompt_logprobs) == (2, None)
    zero = post(client, "/v1/completions", {"prompt": [10], "max_tokens": 1, "logprobs": 0})
    assert zero["choices"][0]["logprobs"]["top_logprobs"] == [{decode(10): -0.1}]


def test_echo_puts_the_prompt_and_its_logprobs_first(client, engine):
    prompt = [10, 11, 12]
    decode = engine.decode
    body = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1})
    [choice] = body["choices"]
    assert choice["text"] == engine.tokenizer.decode(prompt) + decode(10) + decode(11)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [decode(t) for t in [*prompt, 10, 11]]
    assert logprobs["token_logprobs"] == [None, -0.11, -0.12, -0.1, -0.11]
    assert logprobs["top_logprobs"] == [None, *(expected_top(t, 1, decode) for t in [11, 12, 10, 11])]
    assert logprobs["text_offset"] == offsets(logprobs["tokens"])
    assert choice["prompt_logprobs"] is not None, "echo asked the engine for prompt logprobs: vLLM shows them"
    [params] = engine.params.values()
    assert (params.logprobs, params.prompt_logprobs, params.max_tokens) == (1, 1, 2)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, engine):
    prompt = [10, 11, 12]
    body = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    [choice] = body["choices"]
    assert choice["text"] == engine.tokenizer.decode(prompt)
    assert choice["logprobs"]["tokens"] == [engine.decode(t) for t in prompt]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.11, -0.12]
    assert choice["finish_reason"] == "length"
    # As vLLM: the engine samples one token to score the prompt, left out of the text but counted.
    [params] = engine.params.values()
    assert params.max_tokens == 1
    assert body["usage"]["completion_tokens"] == 1
    text = post(client, "/v1/completions", {"prompt": "Hello there", "max_tokens": 0, "echo": True})
    assert text["choices"][0]["text"] == "Hello there" and text["choices"][0]["logprobs"] is None
    assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0}), 400, "max_tokens")


def test_echo_without_logprobs_is_text_only(client, engine):
    body = post(client, "/v1/completions", {"prompt": "Hello there", "max_tokens": 2, "echo": True})
    [choice] = body["choices"]
    assert choice["text"].startswith("Hello there") and len(choice["text"]) > len("Hello there")
    assert choice["logprobs"] is None and "prompt_logprobs" not in choice
    [params] = engine.params.values()
    assert params.prompt_logprobs is None


def test_batched_token_prompts_each_get_their_logprobs(client, engine):
    prompts = [[10, 11, 12, 15], [20, 21]]
    body = post(client, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 1})
    for choice, prompt in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts):
        assert choice["logprobs"]["tokens"] == [engine.decode(t) for t in [*prompt, prompt[0]]]
        assert choice["logprobs"]["token_logprobs"] == [None, *(-t / 100 for t in prompt[1:]), -prompt[0] / 100]


@pytest.mark.parametrize("echo", [False, True])
def test_stream_chunks_carry_their_tokens_logprobs(client, echo):
    # HELD_TOKEN's step has no text, so no chunk: its logprobs come with the next chunk.
    req = {"prompt": [10, HELD_TOKEN, 12], "max_tokens": 5, "logprobs": 2, "echo": echo}
    whole = post(client, "/v1/completions", req)["choices"][0]
    chunks = stream_chunks(client, "/v1/completions", req)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert concatenated(chunks, key) == whole["logprobs"][key], key
    sent = 0  # vLLM's rule in a stream: a chunk's offsets start at the characters sent before it
    for c in chunks:
        logprobs = c["choices"][0]["logprobs"]
        assert logprobs["text_offset"] == offsets(logprobs["tokens"], sent)
        sent += len(c["choices"][0]["text"])
    first = chunks[0]["choices"][0]["logprobs"]
    assert len(first["tokens"]) == (4 if echo else 1), "the echoed prompt comes with the first token"
    assert any(len(c["choices"][0]["logprobs"]["tokens"]) == 2 for c in chunks), "the held token rides along"


def test_return_tokens_as_token_ids(client, engine):
    req = {"prompt": [10, 11], "max_tokens": 2, "logprobs": 1, "echo": True, "return_tokens_as_token_ids": True}
    logprobs = post(client, "/v1/completions", req)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:10", "token_id:11", "token_id:10", "token_id:11"]
    assert logprobs["top_logprobs"][1] == {"token_id:11": -0.11, "token_id:200": -0.1}
    assert logprobs["text_offset"] == [0, 11, 22, 33], "offsets count the strings sent"
    chat = post(client, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "logprobs": True, "top_logprobs": 2})
    [entry] = chat["choices"][0]["logprobs"]["content"]
    req = {"messages": HI, "max_tokens": 1, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    [by_id] = post(client, "/v1/chat/completions", req)["choices"][0]["logprobs"]["content"]
    token_id = int(by_id["token"].removeprefix("token_id:"))
    assert engine.decode(token_id) == entry["token"]
    # vLLM's bytes: the decoded token's for the token itself, the string sent's for the top ones.
    assert by_id["bytes"] == entry["bytes"] == list(entry["token"].encode())
    assert [t["bytes"] for t in by_id["top_logprobs"]] == [list(t["token"].encode()) for t in by_id["top_logprobs"]]


# ---- prompt_logprobs ---------------------------------------------------------------------------


def test_prompt_logprobs_on_the_choice_for_completions_and_beside_for_chat(client, engine):
    prompt = [10, INF_TOKEN, 12]
    body = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1})
    [choice] = body["choices"]
    assert choice["logprobs"] is None
    decode = engine.decode
    assert choice["prompt_logprobs"] == [
        None,
        {str(INF_TOKEN): {"logprob": -9999.0, "rank": 99, "decoded_token": decode(INF_TOKEN)}, "200": top200(decode)},
        {"12": {"logprob": -0.12, "rank": 99, "decoded_token": decode(12)}, "200": top200(decode)},
    ]
    chat = post(client, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "prompt_logprobs": 0})
    assert "prompt_logprobs" not in chat["choices"][0]
    scored = chat["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in scored[1:]), "prompt_logprobs 0: the prompt token alone"


def top200(decode) -> dict:
    return {"logprob": -0.1, "rank": 1, "decoded_token": decode(200)}


# ---- chat ----------------------------------------------------------------------------------------


def test_chat_logprobs_content_and_top_logprobs(client, engine):
    req = {"messages": HI, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    body = post(client, "/v1/chat/completions", req)
    [choice] = body["choices"]
    content = choice["logprobs"]["content"]
    [params] = engine.params.values()
    prompt = engine.prompts[next(iter(engine.params))]
    assert params.logprobs == 2
    assert choice["message"]["content"] == "".join(e["token"] for e in content)
    for entry, token in zip(content, prompt[:3], strict=True):
        text = engine.decode(token)
        assert entry["token"] == text and entry["bytes"] == list(text.encode())
        assert entry["logprob"] == max(made_up_logprob(token), -9999.0)
        # vLLM's slice: the first top_logprobs entries of the engine's dict, the sampled one first.
        assert entry["top_logprobs"] == [
            {"token": text, "logprob": entry["logprob"], "bytes": list(text.encode())},
            {"token": engine.decode(200), "logprob": -0.1, "bytes": list(engine.decode(200).encode())},
        ]
    chunks = stream_chunks(client, "/v1/chat/completions", req)
    assert chunks[0]["choices"][0]["logprobs"] is None, "the role chunk carries no token"
    streamed = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content


def test_chat_logprobs_without_top_logprobs(client, engine):
    for top in ({}, {"top_logprobs": None}):  # null is the default, 0 (vLLM: no logprobs at all)
        content = post(client, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "logprobs": True, **top})
        assert [e["top_logprobs"] for e in content["choices"][0]["logprobs"]["content"]] == [[], []]
    off = post(client, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "logprobs": False, "top_logprobs": 0})
    assert off["choices"][0]["logprobs"] is None
    assert [p.logprobs for p in engine.params.values()] == [0, 0, None]


# ---- bad values --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),  # vLLM's default max_logprobs is 20
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),  # vLLM takes 0
        ("/v1/completions", {"logprobs": "many"}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": -2}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"echo": True}, "echo"),  # chat's echo is not implemented
    ],
)
def test_bad_logprobs_values_are_400s_naming_the_field(client, path, fields, param):
    base = {"prompt": [10, 11], "max_tokens": 2} if path == "/v1/completions" else {"messages": HI, "max_tokens": 2}
    err = assert_error(client.post(path, json={**base, **fields}), 400, param)
    assert param in err["message"]


def test_the_limits_themselves_are_accepted(client):
    assert post(client, "/v1/completions", {"prompt": [10], "max_tokens": 1, "logprobs": 20, "prompt_logprobs": 20})
    assert post(client, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "logprobs": True, "top_logprobs": 20})


# ---- the real engine: lm-evaluation-harness's loglikelihood, and chat, against transformers -------

ATOL = 1e-4  # float32: the engine's paged attention and transformers' sum in different orders


@pytest.fixture(scope="module")
def real_client():
    # float32: the comparison with transformers' float32 log-softmax is to float32 tolerance
    # (the default dtype is bfloat16 on a CPU that has it in hardware).
    engine = LLMEngine(default_model_dir(), **SMALL_ENGINE)
    with TestClient(build_app(engine, "default")) as c:
        yield c, engine.tokenizer


def lm_eval_loglikelihood(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-evaluation-harness 0.4.13 computes from the response (``LocalCompletionsAPI.
    parse_logprobs``): the continuation's summed logprob, ``token_logprobs[ctxlen:-1]`` (the
    last entry is the one generated token), and whether each of its tokens was the most likely."""
    results = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        results.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))))
    return results


@pytest.mark.slow
def test_lm_eval_loglikelihood_equals_transformers(real_client):
    client, tok = real_client
    pairs = [("The capital of France is", " Paris"), ("One, two, three,", " seven eight")]
    contexts = [tok.encode(context) for context, _ in pairs]
    prompts = [ctx + tok.encode(continuation) for ctx, (_, continuation) in zip(contexts, pairs)]
    # lm-eval's local-completions loglikelihood payload, as its _create_payload writes it.
    payload = {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    response = client.post("/v1/completions", json={"model": "default", **payload}).json()
    got = lm_eval_loglikelihood(response, [len(c) for c in contexts])
    model_dir = default_model_dir()
    for (score, greedy), ctx, ids in zip(got, contexts, prompts):
        reference = hf_logprobs(model_dir, ids)
        positions = range(len(ctx), len(ids))
        expected = sum(float(reference[p - 1, ids[p]]) for p in positions)
        assert score == pytest.approx(expected, abs=ATOL * len(positions))
        assert greedy == all(int(reference[p - 1].argmax()) == ids[p] for p in positions)
    assert [g for _, g in got] == [True, False], "the pairs were chosen to give one of each"
    only_prompt = client.post("/v1/completions", json={"model": "default", **payload, "max_tokens": 0}).json()
    for whole, alone, ids in zip(response["choices"], only_prompt["choices"], prompts):
        assert alone["logprobs"]["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"][:-1], abs=ATOL)
        assert alone["logprobs"]["tokens"] == [tok.decode([t]) for t in ids]
        assert alone["text"] == tok.decode(ids)


@pytest.mark.slow
def test_chat_logprobs_equal_transformers(real_client):
    client, tok = real_client
    req = {"model": "default", "messages": HI, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    by_id = client.post("/v1/chat/completions", json={**req, "return_tokens_as_token_ids": True}).json()
    body = client.post("/v1/chat/completions", json={**req, "prompt_logprobs": 2}).json()
    prompt = client.post("/tokenize", json={"model": "default", "messages": HI}).json()["tokens"]
    ids = [int(e["token"].removeprefix("token_id:")) for e in by_id["choices"][0]["logprobs"]["content"]]
    reference = hf_logprobs(default_model_dir(), prompt + ids)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) == 4
    for j, (token, entry) in enumerate(zip(ids, content)):
        row = reference[len(prompt) + j - 1]
        assert entry["token"] == tok.decode([token]) and entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=ATOL)
        top = row.topk(3)
        assert [t["token"] for t in entry["top_logprobs"]] == [tok.decode([t]) for t in top.indices.tolist()]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=ATOL)
    scored = body["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for p in range(1, len(prompt)):
        entry = scored[p][str(prompt[p])]
        assert entry["logprob"] == pytest.approx(float(reference[p - 1, prompt[p]]), abs=ATOL)
        assert entry["decoded_token"] == tok.decode([prompt[p]])
