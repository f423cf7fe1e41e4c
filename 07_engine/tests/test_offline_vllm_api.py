"""vLLM's offline API beyond ``generate``: the engine's global ``seed``, ``trust_remote_code``, the
rule ``bad_words`` bans by.

The engines here run the session's tiny Llama (token-id prompts, no tokenizer), eagerly.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.sampler import banned_bad_words

TINY = dict(dtype="float32", num_kvcache_blocks=64, max_model_len=256, warm_up=False, enforce_eager=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


def _sample(model_dir: str, **kwargs) -> list[list[int]]:
    llm = LLM(model_dir, **TINY, **kwargs)
    try:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_the_global_seed_makes_unseeded_sampling_repeat_and_leaves_the_callers_random_state(tiny_llama_dir):
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    first = _sample(tiny_llama_dir, seed=0)
    assert torch.equal(torch.rand(4), expected_next), "the engine's stream is its own"
    torch.manual_seed(999)  # the caller's state does not decide the engine's draws
    assert _sample(tiny_llama_dir, seed=0) == first
    assert _sample(tiny_llama_dir) == first, "vLLM's default seed is 0"
    assert _sample(tiny_llama_dir, seed=1) != first
    assert len({tuple(t) for t in first}) == len(PROMPTS), "each request draws its own noise"


@pytest.mark.parametrize("seed", ["0", 1.5, True, 2**64])
def test_a_bad_seed_is_refused_by_name(tiny_llama_dir, seed):
    with pytest.raises(ValueError, match="seed"):
        EngineConfig(tiny_llama_dir, seed=seed)


def test_trust_remote_code_is_accepted_and_remote_code_is_never_run(tiny_llama_dir, tmp_path, caplog):
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "remote")
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "modeling_custom.py").write_text("raise RuntimeError('remote code ran')\n")
    with caplog.at_level(logging.WARNING, logger="vllm_from_scratch.config"):
        assert EngineConfig(str(model_dir), trust_remote_code=True).trust_remote_code is True
    (record,) = [r for r in caplog.records if "remote code" in r.getMessage()]
    message = record.getMessage()
    assert "AutoModelForCausalLM" in message and "trust_remote_code=True changes nothing" in message
    assert "LlamaForCausalLM" in message, "it says what runs instead"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_from_scratch.config"):
        EngineConfig(tiny_llama_dir, trust_remote_code=True)
    assert not caplog.records, "a checkpoint that asks for no remote code gets no warning"
    with pytest.raises(ValueError, match="trust_remote_code"):
        EngineConfig(tiny_llama_dir, trust_remote_code="yes")


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    words=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), max_size=4),
    output=st.lists(st.integers(0, 4), max_size=6),
)
def test_a_bad_word_bans_the_token_that_would_complete_it(words, output):
    """vLLM's rule read another way: the next token is banned when, appended to the generated
    tokens, it would make them end with a whole bad word."""
    completing = {w[-1] for w in words if len(w) <= len(output) + 1 and (output + [w[-1]])[-len(w) :] == w}
    assert set(banned_bad_words(words, output)) == completing
