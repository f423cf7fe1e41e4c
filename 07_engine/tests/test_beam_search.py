"""``LLM.beam_search`` against transformers' ``generate(num_beams=...)`` and against vLLM's
definition computed from transformers' logits, on the session's tiny Llama (token-id prompts).

Where the two definitions agree (no EOS: every sequence has the same length) the engine must
return transformers' sequences and summed log-probabilities; with EOS, vLLM's rules
(``beam_search.py``: every EOS candidate ends a sequence, the score counts the prompt, no early
stop) are recomputed here from transformers' own forward passes, with no KV cache.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_from_scratch import LLM, BeamSearchParams
from vllm_from_scratch.beam_search import beam_search_score

ENGINE = dict(dtype="float32", num_kvcache_blocks=96, max_model_len=256, warm_up=False, enforce_eager=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def every_block_returned(llm):
    yield
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.block_manager.all_blocks_free()


@pytest.mark.slow
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    prompts=st.lists(st.lists(st.integers(3, 511), min_size=1, max_size=40), min_size=1, max_size=2),
    beam_width=st.integers(2, 4),  # transformers runs num_beams=1 as greedy search, with no scores
    max_tokens=st.integers(1, 6),
    length_penalty=st.sampled_from([0.0, 1.0, 2.5]),
)
def test_without_eos_the_beams_are_transformers(llm, hf_model, prompts, beam_width, max_tokens, length_penalty):
    params = BeamSearchParams(beam_width, max_tokens, ignore_eos=True, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        expected = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=beam_width,
            num_return_sequences=beam_width,
            max_new_tokens=max_tokens,
            do_sample=False,
            length_penalty=length_penalty,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
        assert [s.tokens[: len(prompt)] for s in output.sequences] == [prompt] * beam_width
        assert [s.tokens[len(prompt) :] for s in output.sequences] == expected.sequences[:, len(prompt) :].tolist()
        # transformers divides by the generated length, vLLM by the whole length: the sums agree.
        hf_sums = (expected.sequences_scores * max_tokens**length_penalty).tolist()
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(hf_sums, abs=1e-4)
        for seq in output.sequences:
            assert len(seq.logprobs) == max_tokens
            assert sum(step[t].logprob for step, t in zip(seq.logprobs, seq.tokens[len(prompt) :])) == pytest.approx(
                seq.cum_logprob, abs=1e-5
            )


def _reference_search(model, prompt: list[int], beam_width: int, max_tokens: int, eos: int, length_penalty: float):
    """vLLM's beam search written out over transformers' logits (whole sequences, no cache)."""

    def score(tokens, cum):
        return beam_search_score(tokens, cum, eos, length_penalty)

    live, done = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * beam_width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token == eos else grown).append((tokens + [token], cum + value))
        live = sorted(grown, key=lambda b: score(*b), reverse=True)[:beam_width]
    return sorted(done + live, key=lambda b: score(*b), reverse=True)[:beam_width]


@pytest.fixture(scope="module")
def frequent_eos_dir(tiny_llama_dir, hf_model, tmp_path_factory):
    """The tiny Llama with EOS moved to a token its first steps rank high, so beams end early."""
    prompt = list(range(5, 25))
    with torch.no_grad():
        second = hf_model(torch.tensor([prompt])).logits[0, -1].topk(3).indices[1].item()
    path = shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("eos") / "model")
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = second
    (path / "config.json").write_text(json.dumps(config))
    return str(path), prompt, second


@pytest.mark.slow
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_with_eos_the_beams_follow_vllms_definition(hf_model, frequent_eos_dir, length_penalty):
    model_dir, prompt, eos = frequent_eos_dir
    llm = LLM(model_dir, **ENGINE)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty)
        (output,) = llm.beam_search([prompt], params)
        assert llm.llm_engine.block_manager.all_blocks_free()
    finally:
        llm.shutdown()
    expected = _reference_search(hf_model, prompt, 3, 5, eos, length_penalty)
    assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
    assert [s.cum_logprob for s in output.sequences] == pytest.approx([cum for _, cum in expected], abs=1e-4)
    assert any(s.tokens[-1] == eos for s in output.sequences), "an ended sequence is among the best"


def test_beams_share_their_prefix_blocks(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    peak = {"shared": 0, "used": 0}
    allocate = bm.allocate_slots

    def watching(seq, num_new_tokens, computed_blocks=()):
        ok = allocate(seq, num_new_tokens, computed_blocks)
        peak["shared"] = max(peak["shared"], max(b.ref_count for b in bm.blocks))
        peak["used"] = max(peak["used"], len(bm.used_block_ids))
        return ok

    prompt = list(range(5, 5 + 3 * bm.block_size + 2))  # three full blocks and a partial one
    engine.block_manager.allocate_slots = watching
    try:
        llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=3, ignore_eos=True))
    finally:
        del engine.block_manager.allocate_slots
    assert peak["shared"] == 4, "all four beams hold the prompt's full blocks at once"
    unshared = 4 * (len(prompt) // bm.block_size + 1)
    assert peak["used"] <= 3 + 4, f"{peak['used']} blocks in use; each beam alone would need {unshared} in all"


def test_text_is_the_decoded_sequence_and_bad_params_are_named(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="params"):
        llm.beam_search([[5, 6]], {"beam_width": 2})
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search([[5] * 250], BeamSearchParams(beam_width=2, max_tokens=10))
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    together = llm.beam_search([[5, 6], [7, 8, 9]], BeamSearchParams(beam_width=2, max_tokens=3))
    one_by_one = llm.beam_search([[5, 6], [7, 8, 9]], BeamSearchParams(beam_width=2, max_tokens=3), concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in one_by_one]
    assert all(s.text is None for o in together for s in o.sequences), "no tokenizer, no text"
