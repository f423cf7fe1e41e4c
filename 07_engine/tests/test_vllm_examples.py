"""vLLM's own offline examples (``07_engine/vllm_examples/``, kept as published) run unchanged on
the book's engine through ``tools/run_vllm_script.py``: the default model stands in for the
Hugging Face ids they name, engines run eagerly, and ``max_tokens`` is capped to stay quick."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_from_scratch import default_model_dir
from vllm_from_scratch.tools.run_vllm_script import run_script

EXAMPLES = Path(__file__).resolve().parents[1] / "vllm_examples"
SETTINGS = {"enforce_eager": True, "warm_up": False, "num_kvcache_blocks": 128, "max_model_len": 512}


def _run(capsys, name: str, *args: str, max_tokens: int = 8) -> str:
    run_script(str(EXAMPLES / name), list(args), default_model_dir(), SETTINGS, max_tokens)
    return capsys.readouterr().out


@pytest.mark.slow
def test_reproducibility_example_repeats_its_sampled_texts(capsys):
    first = re.findall(r"Generated text: (.*)", _run(capsys, "reproducibility.py"))
    assert len(first) == 4 and all(text != "''" for text in first)
    assert re.findall(r"Generated text: (.*)", _run(capsys, "reproducibility.py")) == first, (
        "temperature 0.8 without per-request seeds: the engine's global seed (0) repeats the run"
    )


@pytest.mark.slow
def test_llm_engine_example_drives_add_request_and_step(capsys):
    out = _run(capsys, "llm_engine_example.py", "--max-model-len", "512")
    finished = re.findall(r"RequestOutput\(request_id='(\d)'.*finished=True", out)
    assert finished == ["0", "1", "2"], out
    assert "prompt_logprobs=[None, {" in out, "request 0 asked for prompt logprobs"


@pytest.mark.slow
def test_beam_search_example_prints_the_best_beam(capsys):
    out = _run(capsys, "beam_search.py", max_tokens=4)
    (text,) = re.findall(r"Generated text: '(.*)'", out)
    assert text.startswith("Hello, my name is "), "vLLM's beam text includes the prompt"
    assert len(text) > len("Hello, my name is ")
