"""The start-up warm-up (``EngineConfig.warm_up``, on by default): it runs before the first
request, writes only blocks nobody holds, and so changes no output."""

import argparse

from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.engine import LLMEngine

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 8, 300, 21, 77, 19, 2, 33, 90], [400, 12, 9]]


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_warm_up_runs_at_start_by_default_and_changes_no_output(tiny_llama_dir):
    warm = LLM(tiny_llama_dir, dtype="float32", num_kvcache_blocks=256, enforce_eager=True)
    cold = LLM(tiny_llama_dir, dtype="float32", num_kvcache_blocks=256, warm_up=False, enforce_eager=True)
    assert warm.llm_engine.warm_up_s > 0 and cold.llm_engine.warm_up_s == 0
    assert greedy(warm) == greedy(cold)


def test_the_server_flag_turns_it_off(tiny_llama_dir):
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.cli_kwargs(parser.parse_args([]))["warm_up"] is True
    kwargs = EngineConfig.cli_kwargs(parser.parse_args(["--no-warm-up"]))
    settings = {**kwargs, "dtype": "float32", "num_kvcache_blocks": 64, "enforce_eager": True}
    assert LLMEngine(tiny_llama_dir, **settings).warm_up_s == 0
