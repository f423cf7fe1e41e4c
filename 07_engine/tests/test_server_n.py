"""``n`` on the OpenAI server: ``n`` choices per prompt, laid out, counted and streamed as vLLM's
server does (``vllm/entrypoints/openai/serving_completion.py`` and ``serving_chat.py``).

Against the scripted engine (every value exact): prompt ``p``'s completion ``k`` is choice
``p * n + k``; usage counts each prompt once and every choice's tokens; a stream sends each
chunk about one choice, one finish per choice, and in chat a role chunk per choice;
``continuous_usage_stats``; an echo with logprobs waits for the prompt's scores, which the
engine reports with completion 0 only. Against the real engine (a server process with the
default model, driven by the official ``openai`` client): completion ``k`` of a seeded request is
the single request with ``seed + k`` (the engine's derivation), streamed or not, in both
endpoints, with logprobs and echo; a client that disconnects mid-stream aborts every completion
and the engine frees every block.
"""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import test_server_protocol
from server_testing import ServerProcess
from test_server import _abort_count, _assert_idle_soon
from test_server_logprobs import made_up_entry, offsets, post, stream_chunks
from test_server_protocol import MODEL, ScriptedEngine
from vllm_from_scratch.api_server import build_app

HI = [{"role": "user", "content": "hi"}]
PROMPTS = [[20, 21, 22], [30, 31]]

# The protocol tests' fixtures: the default model's tokenizer, a scripted engine, a client of its app.
tokenizer = test_server_protocol.tokenizer
engine = test_server_protocol.engine
client = test_server_protocol.client


def scripted(tokenizer, prompt: list[int], k: int, max_tokens: int) -> str:
    """The scripted engine's completion ``k`` of ``prompt``: the prompt's tokens from the k-th on, cycled."""
    return "".join(tokenizer.decode([prompt[(j + k) % len(prompt)]]) for j in range(max_tokens))


def by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    """Each choice's streamed entries in order; every chunk must be about exactly one choice."""
    entries: dict[int, list[dict]] = defaultdict(list)
    for chunk in chunks:
        [entry] = chunk["choices"]
        entries[entry["index"]].append(entry)
    return dict(entries)


def assert_one_finish_each(entries: dict[int, list[dict]], reason: str = "length") -> None:
    """Each choice's last entry, and only it, carries the finish."""
    for index, xs in entries.items():
        assert [x["finish_reason"] for x in xs] == [None] * (len(xs) - 1) + [reason], index


# ---- the scripted engine: layout, usage, streaming -----------------------------------------------


def test_choices_are_prompt_major_and_each_prompt_counts_once(client, engine, tokenizer):
    body = post(client, "/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 3})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [scripted(tokenizer, p, k, 3) for p in PROMPTS for k in (0, 1)]
    assert body["usage"] == {
        "prompt_tokens": 3 + 2,  # once per prompt, not once per choice
        "completion_tokens": 4 * 3,
        "total_tokens": 5 + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert [p.n for p in engine.params.values()] == [2, 2], "one engine request per prompt, n completions each"


def test_a_stream_gives_each_choice_its_chunks_and_one_finish(client):
    req = {"prompt": PROMPTS, "n": 2, "max_tokens": 3}
    whole = post(client, "/v1/completions", req)
    chunks = stream_chunks(client, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
    last = chunks.pop()
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    entries = by_choice(chunks)
    assert {i: "".join(x["text"] for x in xs) for i, xs in entries.items()} == {
        c["index"]: c["text"] for c in whole["choices"]
    }
    assert_one_finish_each(entries)
    assert all("usage" not in c for c in chunks), "usage in every chunk needs continuous_usage_stats"


def test_chat_n_has_one_role_chunk_per_choice(client, tokenizer):
    prompt = client.post("/tokenize", json={"messages": HI}).json()["tokens"]
    req = {"messages": HI, "n": 2, "max_tokens": 3}
    whole = post(client, "/v1/chat/completions", req)
    assert [(c["index"], c["message"]) for c in whole["choices"]] == [
        (k, {"role": "assistant", "content": scripted(tokenizer, prompt, k, 3)}) for k in (0, 1)
    ]
    assert whole["usage"]["prompt_tokens"] == len(prompt) and whole["usage"]["completion_tokens"] == 6
    chunks = stream_chunks(client, "/v1/chat/completions", req)
    role = {"role": "assistant", "content": ""}
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]] == [(0, role), (1, role)]
    entries = by_choice(chunks[2:])
    assert {i: "".join(x["delta"].get("content", "") for x in xs) for i, xs in entries.items()} == {
        c["index"]: c["message"]["content"] for c in whole["choices"]
    }
    assert_one_finish_each(entries)


def test_continuous_usage_stats_count_each_choice_so_far(client, tokenizer):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream_chunks(
        client, "/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 3, "stream_options": options}
    )
    final = chunks.pop()
    assert final["usage"]["prompt_tokens"] == 5 and final["usage"]["completion_tokens"] == 12
    for index, xs in by_choice(chunks).items():
        prompt_tokens = len(PROMPTS[index // 2])
        got = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks if c["choices"][0] in xs]
        assert got == [(prompt_tokens, 1), (prompt_tokens, 2), (prompt_tokens, 3)], index  # a token a step
    chat = stream_chunks(
        client, "/v1/chat/completions", {"messages": HI, "n": 2, "max_tokens": 2, "stream_options": options}
    )
    assert [c["usage"]["completion_tokens"] for c in chat[:2]] == [0, 0], "the role chunks come before any token"
    assert all(c["usage"]["completion_tokens"] in (1, 2) for c in chat[2:-1])
    alone = stream_chunks(
        client, "/v1/completions", {"prompt": PROMPTS, "stream_options": {"continuous_usage_stats": True}}
    )
    assert all("usage" not in c for c in alone), "as in vLLM, continuous_usage_stats rides on include_usage"


class ChildZeroScoresEngine(ScriptedEngine):
    """The scripted engine with made-up logprobs (``test_server_logprobs``' values), reporting a
    request with ``n`` > 1 as ``LLMEngine`` does: the prompt's logprobs only with completion 0,
    and here, the worst order a server may meet, completion 0's outputs after the others' in
    each step."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.prompts: dict[str, list[int]] = {}

    def add_request(self, prompt, params=None, request_id=None, priority=0, fit_max_tokens=True):
        rid = super().add_request(prompt, params, request_id, priority, fit_max_tokens)
        self.prompts[rid] = self.requests[rid]["prompt"]
        return rid

    def step(self):
        outputs = super().step()
        for out in outputs:
            params, prompt = self.params[out.request_id], self.prompts[out.request_id]
            (completion,) = out.outputs
            if params.logprobs is not None:
                completion.logprobs = [made_up_entry(t, params.logprobs, self.decode) for t in completion.token_ids]
            if params.prompt_logprobs is not None and completion.index == 0:
                out.prompt_logprobs = [
                    None,
                    *(made_up_entry(t, params.prompt_logprobs, self.decode) for t in prompt[1:]),
                ]
        return self.mark_finished(sorted(outputs, key=lambda out: -out.outputs[0].index))

    def decode(self, token: int) -> str:
        return self.tokenizer.decode([token])


@pytest.fixture
def scoring(tokenizer):
    engine = ChildZeroScoresEngine(tokenizer)
    with TestClient(build_app(engine, MODEL)) as c:
        yield c, engine


def test_echo_with_logprobs_gives_every_choice_the_prompts_scores(scoring):
    client, engine = scoring
    prompt = [10, 11, 12]
    prompt_scores = [None, -0.11, -0.12]  # the made-up logprob of token t is -t / 100
    req = {"prompt": prompt, "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1}
    whole = post(client, "/v1/completions", {**req, "prompt_logprobs": 1})
    for k, choice in enumerate(whole["choices"]):
        generated = [prompt[(j + k) % 3] for j in range(3)]
        assert choice["text"] == engine.tokenizer.decode(prompt) + scripted(engine.tokenizer, prompt, k, 3)
        assert choice["logprobs"]["tokens"] == [engine.decode(t) for t in [*prompt, *generated]]
        assert choice["logprobs"]["token_logprobs"] == [*prompt_scores, *(-t / 100 for t in generated)]
    # vLLM puts the prompt's logprobs on every choice of the prompt; the engine scored it once.
    assert whole["choices"][0]["prompt_logprobs"] == whole["choices"][1]["prompt_logprobs"] is not None
    # Streamed, completion 1's first tokens come before completion 0 has reported the scores: its
    # echo waits for them rather than going out unscored.
    entries = by_choice(stream_chunks(client, "/v1/completions", req))
    for index, xs in entries.items():
        choice = whole["choices"][index]
        assert xs[0]["logprobs"]["token_logprobs"][:3] == prompt_scores, index
        assert "".join(x["text"] for x in xs) == choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert [v for x in xs for v in x["logprobs"][key]] == choice["logprobs"][key], (index, key)
        sent = 0
        for x in xs:
            assert x["logprobs"]["text_offset"] == offsets(x["logprobs"]["tokens"], sent)
            sent += len(x["text"])
    assert_one_finish_each(entries)


# ---- the real engine: a server process with the default model -----------------------------------

LONG = "The quick brown fox jumps over the lazy dog. " * 3 + "Once upon a time"  # over one KV block
SHORT = "Count to ten:"
SEED = 1234
SAMPLED = dict(model="SmolLM2-135M-Instruct", max_tokens=6, temperature=1.0, seed=SEED)
ATOL = 1e-4  # float32; a request's batch differs from its single twin's


@pytest.fixture(scope="module")
def base_url():
    args = ["vllm_from_scratch.serve", "--dtype", "float32", "--max-model-len", "512", "--num-kvcache-blocks", "160"]
    args += ["--enforce-eager", "--no-warm-up"]  # as every test but test_compile.py: no graphs compiled for one module
    with ServerProcess([*args, "--max-num-seqs", "16", "--log-level", "warning"], startup_timeout_s=180) as server:
        yield server.url


@pytest.fixture(scope="module")
def real(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


def singles(create, seeds: range, **kw) -> list:
    """One ``n=1`` request per seed, each its own response."""
    return [create(**{**SAMPLED, **kw, "seed": seed}) for seed in seeds]


@pytest.mark.slow
def test_seeded_choices_are_the_single_requests_with_seed_plus_k(real):
    kw = dict(prompt=LONG, logprobs=1, extra_body={"ignore_eos": True})
    many = real.completions.create(**SAMPLED, n=3, **kw)
    ones = singles(real.completions.create, range(SEED, SEED + 3), **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [one.choices[0].text for one in ones]
    assert len({c.text for c in many.choices}) > 1, "three seeds should not all sample alike"
    for choice, one in zip(many.choices, ones):
        assert choice.logprobs.tokens == one.choices[0].logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(one.choices[0].logprobs.token_logprobs, abs=ATOL)
    assert many.usage.prompt_tokens == ones[0].usage.prompt_tokens, "the prompt counts once"
    assert many.usage.completion_tokens == 3 * 6


@pytest.mark.slow
def test_two_prompts_by_two_streamed_or_not(real):
    kw = dict(extra_body={"ignore_eos": True})
    whole = real.completions.create(**SAMPLED, prompt=[LONG, SHORT], n=2, **kw)
    ones = [singles(real.completions.create, range(SEED, SEED + 2), prompt=p, **kw) for p in (LONG, SHORT)]
    expected = [r.choices[0].text for both in ones for r in both]
    assert [(c.index, c.text) for c in whole.choices] == list(enumerate(expected))
    prompt_tokens = ones[0][0].usage.prompt_tokens + ones[1][0].usage.prompt_tokens
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 4 * 6)
    stream = real.completions.create(
        **SAMPLED, prompt=[LONG, SHORT], n=2, stream=True, stream_options={"include_usage": True}, **kw
    )
    chunks = [c.model_dump() for c in stream]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4 * 6
    entries = by_choice(chunks[:-1])
    assert {i: "".join(x["text"] for x in xs) for i, xs in entries.items()} == {c.index: c.text for c in whole.choices}
    assert_one_finish_each(entries)


@pytest.mark.slow
def test_chat_n_streamed_or_not(real):
    kw = dict(messages=HI, extra_body={"ignore_eos": True})
    whole = real.chat.completions.create(**SAMPLED, n=2, **kw)
    ones = singles(real.chat.completions.create, range(SEED, SEED + 2), **kw)
    assert [(c.index, c.message.content) for c in whole.choices] == [
        (k, one.choices[0].message.content) for k, one in enumerate(ones)
    ]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (ones[0].usage.prompt_tokens, 2 * 6)
    chunks = [c.model_dump() for c in real.chat.completions.create(**SAMPLED, n=2, stream=True, **kw)]
    roles = [(c["choices"][0]["index"], c["choices"][0]["delta"]["role"]) for c in chunks[:2]]
    assert roles == [(0, "assistant"), (1, "assistant")]
    entries = by_choice(chunks[2:])
    texts = {i: "".join(x["delta"]["content"] or "" for x in xs) for i, xs in entries.items()}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert_one_finish_each(entries)


@pytest.mark.slow
def test_echo_with_n_shows_the_prompt_on_every_choice(real, base_url):
    kw = dict(prompt=LONG, echo=True, logprobs=1, max_tokens=3)
    many = real.completions.create(**{**SAMPLED, **kw}, n=2)
    one = real.completions.create(**{**SAMPLED, **kw})
    prompt = httpx.post(base_url + "/tokenize", json={"prompt": LONG}).json()["tokens"]
    ones = singles(real.completions.create, range(SEED, SEED + 2), prompt=LONG, max_tokens=3)
    for choice, single in zip(many.choices, ones):
        assert choice.text == LONG + single.choices[0].text
        scored = choice.logprobs.token_logprobs[: len(prompt)]
        assert scored[0] is None and scored[1:] == pytest.approx(
            one.choices[0].logprobs.token_logprobs[1 : len(prompt)], abs=ATOL
        )
    raw = httpx.post(
        base_url + "/v1/completions", json={**SAMPLED, "prompt": LONG, "n": 2, "max_tokens": 2, "prompt_logprobs": 0}
    ).json()
    first, second = (c["prompt_logprobs"] for c in raw["choices"])
    assert first == second and len(first) == len(prompt), "the prompt's scores on every choice, as vLLM"


@pytest.mark.slow
def test_disconnect_mid_stream_aborts_every_completion(base_url):
    aborted_before = _abort_count(base_url)
    body = {"prompt": LONG, "n": 2, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base_url + "/v1/completions", json=body) as resp:
            received = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    received.append(json.loads(line[6:]))
                if len(received) >= 4:
                    break
    assert {c["choices"][0]["index"] for c in received} == {0, 1}, "both completions were running"
    _assert_idle_soon(base_url)  # nothing runs and every KV block is back
    assert _abort_count(base_url) == aborted_before + 2, "each completion counts as aborted"
