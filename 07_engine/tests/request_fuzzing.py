"""Request bodies drawn across the OpenAI surface, and what makes an answer to one wrong.

:func:`requests` draws ``(path, body)`` for ``/v1/completions``, ``/v1/chat/completions``,
``/tokenize`` and ``/detokenize``: every field either API defines, with values from its domain
and just outside it (NaN, infinities, huge and negative ints, empty and long lists, lone UTF-16
surrogates, unknown fields, wrong types), in any combination. :func:`fault` says what is wrong
with an answer, or None: a server that fails a request must only cost that request a 4xx that
names the field at fault. Used by ``test_server_fuzz.py`` and ``benchmarks/fuzz_compare.py``.
"""

from __future__ import annotations

import json
import math
import re

import httpx
from hypothesis import strategies as st

VOCAB = 49152  # the default model's tokenizer, which the fuzzed servers use
MODEL = "fuzz"
# Fields a request must have: a 400 may name one of these although the body left it out.
REQUIRED = {
    "/v1/completions": {"prompt"},
    "/v1/chat/completions": {"messages"},
    "/tokenize": {"prompt"},
    "/detokenize": {"tokens"},
}

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
# Hostile values: just outside every domain.
TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec="utf-8") | SURROGATES, max_size=8),
    st.sampled_from(["", " ", "\x00", "a\ud800b", "\udfff", "🙂 ok", "\u202e", "Paris", "<|im_end|>"]),
)
NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3, 3),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 0.5, 1e-300, 1e-7, 1e300, 2**63, 2**64]),
)
SMALL_INT = st.integers(-3, 12) | st.sampled_from([0, 1, 20, 21, VOCAB, 2**31, -(2**63), 2**64])
TOKEN_IDS = st.lists(st.integers(-3, VOCAB + 3) | st.integers(-(2**66), 2**66), max_size=40)
JSON_ANY = st.recursive(
    st.none() | st.booleans() | NUMBER | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=8,
)
# Valid values, extremes of each domain included (a vanishing repetition penalty is one).
WORDS = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=24) | st.sampled_from(
    ["The capital of France is", "Once upon a time", "1, 2, 3,", "<|im_start|>user\nhi<|im_end|>"]
)
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60)
UNIT = st.floats(0, 1) | st.sampled_from([0.0, 1e-6, 1.0])


def field(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: from its domain four times in five, else from just outside it. Mostly
    valid bodies reach the engine, where a few odd values are the most dangerous."""
    return st.one_of(valid, valid, valid, valid, hostile)


def _message() -> st.SearchStrategy:
    role = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
    content = WORDS | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}), max_size=3)
    valid = st.fixed_dictionaries({"role": role, "content": content})
    hostile = st.fixed_dictionaries({"role": role | TEXT, "content": TEXT | st.none()}, optional={"name": TEXT})
    return field(valid, hostile | JSON_ANY)


SAMPLING = {
    "model": field(st.just(MODEL), TEXT),
    "max_tokens": field(st.integers(1, 8) | st.none(), SMALL_INT | NUMBER),
    "n": field(st.integers(1, 4), SMALL_INT | NUMBER),
    "temperature": field(st.floats(0, 2) | st.sampled_from([0.0, 1e-7, 0.01, 2.0]), NUMBER),
    "top_p": field(UNIT.filter(lambda x: x > 0), NUMBER),
    "top_k": field(st.integers(-1, 50) | st.just(VOCAB), SMALL_INT | NUMBER),
    "min_p": field(UNIT, NUMBER),
    "presence_penalty": field(st.floats(-2, 2), NUMBER),
    "frequency_penalty": field(st.floats(-2, 2), NUMBER),
    "repetition_penalty": field(st.floats(0.5, 2) | st.sampled_from([1e-300, 1e-30, 1e-7, 1e7, 1e30, 1e300]), NUMBER),
    "seed": field(st.integers(-(2**63), 2**64 - 1), NUMBER),
    "stop": field(WORDS | st.lists(WORDS.filter(bool), max_size=4), TEXT | st.lists(TEXT, max_size=6) | JSON_ANY),
    "stop_token_ids": field(st.lists(st.integers(0, VOCAB - 1), max_size=8), TOKEN_IDS | st.just(list(range(VOCAB)))),
    "min_tokens": field(st.integers(0, 8), SMALL_INT | st.integers(0, 200)),
    "ignore_eos": field(st.booleans(), JSON_ANY),
    "logit_bias": field(
        st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100) | st.sampled_from([-1e9, 1e9])),
        st.dictionaries(st.integers(-3, VOCAB + 3).map(str) | TEXT, NUMBER, max_size=6)
        | st.just({str(t): -100 for t in range(0, VOCAB, 7)}),
    ),
    "bad_words": field(st.lists(WORDS.filter(bool), max_size=4), st.lists(TEXT, max_size=6) | JSON_ANY),
    "allowed_token_ids": field(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), TOKEN_IDS | st.just(list(range(VOCAB)))
    ),
    "prompt_logprobs": field(st.integers(0, 20), SMALL_INT),
    "include_stop_str_in_output": field(st.booleans(), JSON_ANY),
    "skip_special_tokens": field(st.booleans(), JSON_ANY),
    "truncate_prompt_tokens": field(st.integers(1, 128) | st.just(-1), SMALL_INT | st.integers(1, 300)),
    "stream": st.booleans(),
    "stream_options": field(
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
        JSON_ANY,
    ),
    "request_id": field(st.text("abcdef0123456789-", min_size=1, max_size=12), TEXT),
    "priority": field(st.just(0), SMALL_INT),
    "user": field(WORDS, TEXT),
    "return_tokens_as_token_ids": st.booleans(),
    "temprature": NUMBER,  # a field no API defines
    "best_of": field(st.just(1), SMALL_INT),
    "response_format": field(st.just({"type": "text"}), JSON_ANY),
}
ENDPOINT_FIELDS: dict[str, dict[str, st.SearchStrategy]] = {
    "/v1/completions": {
        **SAMPLING,
        "prompt": field(
            WORDS | IDS | st.lists(WORDS, min_size=1, max_size=4) | st.lists(IDS, min_size=1, max_size=3),
            TEXT | TOKEN_IDS | st.lists(TEXT, max_size=4) | st.lists(TOKEN_IDS, max_size=3) | JSON_ANY,
        ),
        "logprobs": field(st.integers(0, 20), SMALL_INT | JSON_ANY),
        "echo": field(st.booleans(), JSON_ANY),
        "suffix": field(st.just(""), TEXT),
    },
    "/v1/chat/completions": {
        **SAMPLING,
        "messages": field(st.lists(_message(), min_size=1, max_size=4), JSON_ANY),
        "logprobs": field(st.booleans(), JSON_ANY),
        "top_logprobs": field(st.integers(0, 20), SMALL_INT),
        "max_completion_tokens": field(st.integers(1, 8), SMALL_INT),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "chat_template_kwargs": field(st.just({}), st.dictionaries(TEXT, JSON_ANY, max_size=2)),
        "tools": field(st.just([]), JSON_ANY),
    },
    "/tokenize": {
        "model": field(st.just(MODEL), TEXT),
        "prompt": field(WORDS, TEXT | JSON_ANY),
        "messages": st.lists(_message(), max_size=3),
        "add_special_tokens": field(st.booleans(), JSON_ANY),
        "add_generation_prompt": st.booleans(),
        "return_token_strs": st.booleans(),
    },
    "/detokenize": {"model": field(st.just(MODEL), TEXT), "tokens": field(IDS, TOKEN_IDS | JSON_ANY)},
}
# The fields that make each a request: most drawn bodies have them, plus any others.
CORE = {
    "/v1/completions": {"prompt", "max_tokens"},
    "/v1/chat/completions": {"messages", "max_tokens"},
    "/tokenize": {"prompt"},
    "/detokenize": {"tokens"},
}


# The fields that reach the sampler and the logprobs: the dangerous ones are their combinations.
SAMPLER_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias", "logprobs", "prompt_logprobs", "echo",
    "top_logprobs", "bad_words", "allowed_token_ids",
)  # fmt: skip


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict]:
    """One ``(path, body)``: mostly its core fields, up to four others, and for the generation
    endpoints up to five of the fields that reach the sampler."""
    path = draw(st.sampled_from(sorted(ENDPOINT_FIELDS)))
    fields = ENDPOINT_FIELDS[path]
    names = set(draw(st.sets(st.sampled_from(sorted(fields)), max_size=4)))
    if draw(st.integers(0, 4)):
        names |= CORE[path]
    if path.startswith("/v1/"):
        knobs = sorted(name for name in SAMPLER_FIELDS if name in fields)
        names |= draw(st.sets(st.sampled_from(knobs), max_size=5))
    return path, {name: draw(fields[name]) for name in sorted(names)}


def encode(body: dict) -> bytes:
    """``body`` as a client sends it, NaN and Infinity as the JSON extension Python writes."""
    return json.dumps(body, allow_nan=True).encode()


def fault(path: str, body: object, response: httpx.Response) -> str | None:
    """What is wrong with ``response`` to ``body`` (the parsed JSON; None when it is not JSON), a
    short description that names the kind of fault, or None. A 200 must hold together: the
    choices, their finish reasons, finite logprobs, a stream that ends with ``[DONE]`` and
    carries no error event. Anything else must be a 4xx in OpenAI's JSON shape, and a 400 about
    a JSON object must name a field it sent (or a required one it left out)."""
    status = response.status_code
    if status >= 500:
        return f"{status} on {path}: {_message_of(response)}"
    if status != 200:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} on {path} without OpenAI's JSON error body: {response.text[:60]!r}"
        if status == 400 and isinstance(body, dict):
            param = error.get("param")
            if param is None:
                return f"400 on {path} naming no field: {_shape(error.get('message', ''))}"
            head = param if param in body else re.split(r"[.\[]", param, maxsplit=1)[0]
            if head not in body and head not in REQUIRED.get(path, ()):
                return f"400 on {path} naming {head!r}, which the body did not send"
        return None
    if not isinstance(body, dict):
        return None
    if body.get("stream") is True and path.startswith("/v1/"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"a stream on {path} that does not end with [DONE]"
        if any("error" in json.loads(e) for e in events[:-1]):
            return f"an error event in a stream on {path}: {_shape(events[-2])}"
        return None
    answer = response.json()
    if path.startswith("/v1/"):
        if not answer.get("choices"):
            return f"a 200 on {path} without choices"
        for choice in answer["choices"]:
            if choice["finish_reason"] not in ("stop", "length"):
                return f"finish reason {choice['finish_reason']!r} on {path}"
            for lp in (choice.get("logprobs") or {}).get("token_logprobs") or []:
                if lp is not None and not math.isfinite(lp):
                    return f"a logprob of {lp} on {path}"
    return None


def _message_of(response: httpx.Response) -> str:
    try:
        return _shape(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"plain text {_shape(response.text)}"


def _shape(text: str) -> str:
    """A message with its numbers and quoted values blanked, so one kind of fault reads the same."""
    return re.sub(r"'[^']*'|\"[^\"]*\"|-?\d+(\.\d+)?(e[-+]?\d+)?", "#", text)[:80]
