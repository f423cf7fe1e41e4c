"""Structured outputs offline: every completion under a drawn JSON schema, a regex, a choice or a
grammar satisfies it, with ``n`` > 1, speculative decoding, chunked prefill and preemption; a
constraint that cannot compile is refused by name; unconstrained rows are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_from_scratch import LLM, SamplingParams, StructuredOutputsParams, default_model_dir
from vllm_from_scratch.structured_output import GrammarOutput, apply_grammar_bitmask

PROMPT = "Answer with JSON only. Describe a book: its title, its year, its tags."


def _leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
        st.builds(
            lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
            st.integers(-50, 50),
            st.integers(0, 99),
        ),
        st.just({"type": "boolean"}),
        st.builds(
            lambda vs: {"enum": vs},
            st.lists(st.sampled_from(["red", "green", "a b", 'q"uote', "ü"]), min_size=1, max_size=3, unique=True),
        ),
        st.builds(
            lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": n},
            st.integers(0, 3),
        ),
    )


def _object(values: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.lists(st.sampled_from(["title", "year", "tags", "ok", "note"]), min_size=1, max_size=3, unique=True)
    return names.flatmap(
        lambda keys: st.tuples(*[values for _ in keys]).map(
            lambda schemas: {
                "type": "object",
                "properties": dict(zip(keys, schemas)),
                "required": list(keys),
                "additionalProperties": False,
            }
        )
    )


# Bounded schemas (short strings, ranged integers, short arrays, one level of nesting): a finished
# output must validate, and the bounds let the 135M model finish well inside max_tokens.
SCHEMAS = _object(st.one_of(_leaf(), _object(_leaf())))


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_dir(), enforce_eager=True, num_kvcache_blocks=256, max_model_len=512, warm_up=False)


def _outputs(llm, prompts, params):
    return [c for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


@pytest.mark.slow
@settings(max_examples=3, deadline=None, derandomize=True)
@given(schemas=st.lists(SCHEMAS, min_size=2, max_size=2))
def test_every_sample_of_a_drawn_schema_validates(llm, schemas):
    params = [
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=i,
            max_tokens=128,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for i, schema in enumerate(schemas)
    ]
    outs = llm.generate([PROMPT] * len(schemas), params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_and_grammar(llm):
    grammar = 'root ::= term ("+" | "*") term\nterm ::= [1-9] [0-9]?'
    cases = [
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{1,6}-\d{2}"), lambda t: re.fullmatch(r"[A-Z][a-z]{1,6}-\d{2}", t)),
        (StructuredOutputsParams(choice=["red", "green", 'say "hi"']), lambda t: t in ("red", "green", 'say "hi"')),
        (StructuredOutputsParams(grammar=grammar), lambda t: re.fullmatch(r"[1-9][0-9]?[+*][1-9][0-9]?", t)),
    ]
    params = [SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, structured_outputs=so) for so, _ in cases]
    outs = llm.generate(["Pick one."] * len(cases), params, use_tqdm=False)
    for (so, ok), out in zip(cases, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (so, c.text)
            assert ok(c.text), (so, c.text)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(json={"type": "nonsense"}), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(regex="[a-"), "structured_outputs.regex"),
        (dict(grammar="root ::= "), "structured_outputs.grammar"),
        (dict(choice=[]), "structured_outputs.choice"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_by_name(llm, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)), use_tqdm=False)


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams()


def test_unconstrained_rows_are_untouched_by_a_constrained_neighbour(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = _outputs(llm, ["The capital of France is"], plain)[0]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=["x"])
    )
    together = _outputs(llm, ["The capital of France is", "Say x."], [plain, constrained])
    assert together[0].token_ids == alone.token_ids
    assert together[1].text == "x"


@pytest.mark.slow
def test_constrained_with_spec_decoding_chunked_prefill_and_preemption():
    # 16 blocks of 16 tokens for 4 requests of ~90 tokens each: requests are preempted and
    # resume with their matcher; 32-token steps split the prompts; ngram drafts are checked.
    llm = LLM(
        default_model_dir(),
        enforce_eager=True,
        num_kvcache_blocks=16,
        max_model_len=256,
        max_num_batched_tokens=32,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        warm_up=False,
    )
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 12},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    }
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=64, structured_outputs=so) for i, t in enumerate([0, 1] * 2)
    ]
    prompts = [f"{PROMPT} Book number {i}, with the same keys as before: title, year." * 2 for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    num_rows=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    constrained=st.lists(st.booleans(), min_size=5, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_the_mask_reaches_exactly_the_constrained_rows(num_rows, constrained, seed):
    vocab = 70  # not a multiple of 32: the last mask word is partial
    gen = torch.Generator().manual_seed(seed)
    ids = [f"r{i}" for i in range(len(num_rows))]
    logits = torch.randn(sum(num_rows), vocab, generator=gen)
    picked = [(rid, n) for rid, n, c in zip(ids, num_rows, constrained) if c and n]
    width = xgr.get_bitmask_shape(1, vocab)[1]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (sum(n for _, n in picked), width), generator=gen, dtype=torch.int32)
    expected = logits.clone()
    starts = {rid: sum(num_rows[:i]) for i, rid in enumerate(ids)}
    mask_row = 0
    for rid, n in picked:
        for j in range(n):
            bits = [(int(bitmask[mask_row, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
            expected[starts[rid] + j, torch.tensor(bits) == 0] = float("-inf")
            mask_row += 1
    apply_grammar_bitmask(logits, GrammarOutput([r for r, _ in picked], [n for _, n in picked], bitmask), ids, num_rows)
    assert torch.equal(logits, expected)
