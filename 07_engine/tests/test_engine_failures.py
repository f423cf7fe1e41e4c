"""No request can take the engine down: degenerate distributions, failing steps and hostile
parameters cost at most that request, with an error, and every KV block comes back.

The last test draws whole ``SamplingParams`` (every field, in range and out of it) with
Hypothesis and runs them through ``LLM.generate`` on a tiny model: each is refused with a
``ValueError`` naming a field, or it generates ids inside the vocabulary; nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_engine_parity import BLOCK, assert_no_leak
from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.sampler import NO_TOKEN, Sampler

VOCAB = 512  # conftest's tiny checkpoints
PROMPT = list(range(3, 60))
# Drawn examples per run: a fast profile by default, a longer one on demand (07_engine/topics/serving.md).
FUZZ_EXAMPLES = int(os.environ.get("VLLM_FS_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=48,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        enforce_eager=True,
        warm_up=False,
    )


def test_a_vanishing_repetition_penalty_samples_among_the_infinite_logits(llm):
    # 1e-300 is 0 in float32: every positive logit of a seen token becomes +inf. The row's limit
    # is uniform over those tokens, all from the prompt, instead of an id past the vocabulary.
    for temperature in (0.0, 1.0):
        params = SamplingParams(repetition_penalty=1e-300, temperature=temperature, max_tokens=6, seed=1)
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "length"
        assert set(out.outputs[0].token_ids) <= set(PROMPT), out.outputs[0].token_ids
    assert_no_leak(llm)


def test_a_row_with_no_token_ends_only_its_request_with_an_error(llm, monkeypatch):
    draw = Sampler.draw

    def no_token_for_the_first_row(logits, *args):
        sampled = draw(logits, *args)
        sampled[0] = NO_TOKEN
        return sampled

    monkeypatch.setattr(Sampler, "draw", staticmethod(no_token_for_the_first_row))
    engine = llm.llm_engine
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0.0), request_id="doomed")
    engine.add_request(PROMPT[:9], SamplingParams(max_tokens=4, temperature=0.0), request_id="fine")
    first = {o.request_id: o.outputs[0] for o in engine.step()}
    assert first["doomed"].finish_reason == "error" and "no token" in (first["doomed"].error or "")
    assert first["doomed"].token_ids == [], "the NO_TOKEN id must never join the sequence"
    monkeypatch.undo()
    outs = []
    while engine.has_unfinished_requests():
        outs += [o.outputs[0] for o in engine.step()]
    assert [o.finish_reason for o in outs if o.finished()] == ["length"]
    assert_no_leak(llm)


def test_after_a_step_that_raises_the_engine_ends_its_requests_and_goes_on(llm, monkeypatch):
    engine = llm.llm_engine
    runner = engine.executor.runner

    def broken(_):
        raise RuntimeError("a kernel bug")

    monkeypatch.setattr(runner, "execute_model", broken)
    engine.add_request(PROMPT, SamplingParams(max_tokens=4), request_id="a")
    engine.add_request(PROMPT[:20], SamplingParams(max_tokens=4), request_id="b")
    engine.add_request(PROMPT[:9], SamplingParams(max_tokens=4), request_id="gone")
    engine.abort_request("gone")  # its end is reported by the next step, which fails
    with pytest.raises(RuntimeError, match="a kernel bug"):
        engine.step()  # offline, the exception reaches the caller, as in vLLM
    outs = engine.recover_from_failed_step(RuntimeError("a kernel bug"))
    ends = sorted((o.request_id, o.outputs[0].finish_reason) for o in outs)
    assert ends == [("a", "error"), ("b", "error"), ("gone", "abort")], "every end is reported, the abort too"
    assert all("a kernel bug" in (o.outputs[0].error or "") for o in outs if o.outputs[0].finish_reason == "error")
    monkeypatch.undo()
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    assert llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        # max_tokens None leaves 128 - 57 = 71 tokens of context: min_tokens cannot be met.
        (dict(min_tokens=100, max_tokens=None), "min_tokens"),
        # Every id is a stop token, banned until min_tokens are out: nothing to sample.
        (dict(min_tokens=2, stop_token_ids=list(range(VOCAB))), "stop_token_ids"),
        (dict(min_tokens=2, stop_token_ids=[t for t in range(VOCAB) if t != 2]), "stop_token_ids"),  # + EOS
        (dict(n=9), "n"),  # max_n_sequences defaults to max_num_seqs (8 here)
    ],
)
def test_requests_that_cannot_be_honoured_are_refused_up_front(llm, kwargs, field):
    with pytest.raises(ParameterError) as err:
        llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    assert err.value.param == field, str(err.value)
    assert_no_leak(llm)


def test_temperature_follows_vllms_bounds():
    with pytest.raises(ParameterError, match="temperature"):
        SamplingParams(temperature=2.5)
    assert SamplingParams(temperature=1e-7).temperature == 0.01  # raised, as vLLM raises it
    assert SamplingParams(temperature=0.0).greedy


# ---- the whole SamplingParams domain, drawn ----------------------------------------------------

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3.0, 3.0),
    st.sampled_from([0.0, 1e-300, 1e-30, 1e-7, 1e30, 1e300]),
)
INTS = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.sampled_from([VOCAB - 1, VOCAB, 2**63]))
TOKEN_LISTS = st.lists(st.integers(-2, VOCAB + 2), max_size=8) | st.just(list(range(VOCAB)))


@st.composite
def sampling_kwargs(draw):
    """Any subset of SamplingParams' fields, each drawn from its domain and just outside it."""
    options = {
        "n": st.integers(-1, 10),
        "temperature": st.one_of(FLOATS, st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        "top_p": FLOATS,
        "top_k": INTS,
        "max_tokens": st.none() | st.integers(-1, 12) | st.just(10**6),
        "min_tokens": st.integers(-1, 80),
        "ignore_eos": st.booleans(),
        "stop": st.none() | st.lists(st.text(max_size=3), max_size=3),
        "stop_token_ids": st.none() | TOKEN_LISTS,
        "seed": st.none() | INTS,
        "presence_penalty": FLOATS,
        "frequency_penalty": FLOATS,
        "repetition_penalty": FLOATS,
        "min_p": FLOATS,
        "logit_bias": st.none()
        | st.dictionaries(st.integers(-1, VOCAB + 1), st.floats(allow_nan=True), max_size=6)
        | st.just({t: -100.0 for t in range(VOCAB)}),
        "logprobs": st.none() | st.integers(-1, 6) | st.just(VOCAB + 1),
        "prompt_logprobs": st.none() | st.integers(-1, 6),
        "truncate_prompt_tokens": st.none() | st.integers(-2, 200),
    }
    names = draw(st.sets(st.sampled_from(sorted(options)), max_size=len(options)))
    return {name: draw(options[name]) for name in sorted(names)}


FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt"}


@settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(kwargs=sampling_kwargs(), prompt_len=st.integers(1, 127))
def test_drawn_sampling_params_are_refused_by_name_or_generate_in_vocabulary(llm, kwargs, prompt_len):
    prompt = [3 + i % (VOCAB - 3) for i in range(prompt_len)]
    try:
        params = SamplingParams(**kwargs)
        outs = llm.generate([prompt, prompt[:5]], params, use_tqdm=False)
    except ParameterError as err:
        assert err.param.split("[")[0] in FIELDS, f"{kwargs}: the error names {err.param!r}, no field"
    else:
        for out in outs:
            assert len(out.outputs) == params.n
            for completion in out.outputs:
                assert completion.finish_reason in ("stop", "length"), (kwargs, completion)
                assert all(0 <= t < VOCAB for t in completion.token_ids), (kwargs, completion.token_ids)
                for entry in completion.logprobs or []:
                    assert all(not math.isnan(lp.logprob) for lp in entry.values()), kwargs
    assert_no_leak(llm)
    # The engine still answers a plain request as it did before.
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert plain[0].outputs[0].token_ids == _plain_answer(llm)


_PLAIN: list[int] = []


def _plain_answer(llm: LLM) -> list[int]:
    if not _PLAIN:
        with torch.inference_mode():
            _PLAIN.extend(
                llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
    return _PLAIN
