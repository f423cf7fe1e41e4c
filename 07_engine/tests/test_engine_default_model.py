"""The embedded default model (SmolLM2-135M-Instruct) through the engine: a real chat answer,
stop strings on decoded text, and incremental detokenization of multi-byte characters."""

from __future__ import annotations

import pytest

from vllm_from_scratch import LLM, SamplingParams, default_model_dir
from vllm_from_scratch.output_processor import IncrementalDetokenizer
from vllm_from_scratch.sampling_params import RequestOutputKind

# A small float32 engine on the default model (the warm-up is test_engine_warm_up.py's subject).
SMALL_ENGINE = dict(dtype="float32", num_kvcache_blocks=64, max_model_len=512, warm_up=False, enforce_eager=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_dir(), **SMALL_ENGINE)


def chat(llm: LLM, question: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_the_capital_of_france_is_paris(llm):
    out = llm.generate(
        [chat(llm, "What is the capital of France?")], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
    )[0]
    assert "Paris" in out["text"], out["text"]
    assert llm.llm_engine.block_manager.all_blocks_free()


def test_stop_string_is_cut_from_text_and_stream(llm):
    engine = llm.llm_engine
    question = chat(llm, "What is the capital of France?")
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=["Paris"])
    texts = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        engine.add_request(question, params.clone(output_kind=kind), request_id=kind.name)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o.outputs[0] for o in engine.step()]
        last = outs[-1]
        assert last.finished() and last.finish_reason == "stop" and last.stop_reason == "Paris"
        assert all(not o.finished() for o in outs[:-1])
        texts[kind] = [o.text for o in outs]
    whole = texts[RequestOutputKind.CUMULATIVE][-1]
    assert "Paris" not in whole and whole.strip()
    assert "".join(texts[RequestOutputKind.DELTA]) == whole, "the streamed pieces add up to the text"
    assert engine.block_manager.all_blocks_free()


def test_incremental_detokenizer_never_splits_a_character(llm):
    tok = llm.tokenizer
    text = "Déjà vu: 東京 🙂 naïve"
    ids = tok.encode(text)
    prompt = tok.encode("Say:")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for i in range(1, len(ids) + 1):
        before = detok.text
        detok.update(prompt + ids[:i])
        pieces.append(detok.text[len(before) :])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert len([p for p in pieces if p]) < len(ids)  # some tokens were half a character
