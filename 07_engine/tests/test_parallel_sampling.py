"""``SamplingParams.n``: n completions of one prompt, run as n child requests sharing its KV blocks.

The children are vLLM V1's (``vllm/v1/engine/parallel_sampling.py``): ids ``f"{i}_{parent}"``,
seeds ``seed + i``, outputs under the parent's id with ``index=i``. Child 0 computes the prompt;
the others wait until its full blocks are in chapter 03's prefix cache, then hold those blocks
too (reference count n) and compute only the rest.
"""

from __future__ import annotations

import asyncio

import pytest

from block_manager import cdiv
from test_engine_parity import BLOCK, GREEDY, assert_no_leak, hf_greedy, make_prompts
from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.async_llm import AsyncLLM
from vllm_from_scratch.engine import LLMEngine
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.outputs import CompletionOutput, RequestOutput
from vllm_from_scratch.parallel_sampling import ParentRequest
from vllm_from_scratch.sampling_params import RequestOutputKind

PROMPT = make_prompts(31, (5 * BLOCK + 3,))[0]  # 5 full blocks and a partial one
FULL = 5 * BLOCK
SAMPLED = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=7, ignore_eos=True)


def tiny_llm(model_dir: str, **kw) -> LLM:
    kw = {"kvcache_block_size": BLOCK, "num_kvcache_blocks": 64, "dtype": "float32", **kw}
    return LLM(model_dir, **kw, enforce_eager=True)


def run(engine: LLMEngine) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    return ParentRequest("p", params).get_child_info(index)[1]


def test_child_info_derives_seed_and_scores_the_prompt_once():
    params = SamplingParams(n=3, seed=10, prompt_logprobs=2, temperature=0.5)
    parent = ParentRequest("p", params)
    children = [parent.get_child_info(i) for i in range(3)]
    assert [rid for rid, _ in children] == ["0_p", "1_p", "2_p"] and parent.child_requests == {"0_p", "1_p", "2_p"}
    assert [(c.n, c.seed, c.prompt_logprobs) for _, c in children] == [(1, 10, 2), (1, 11, None), (1, 12, None)]
    assert all(c.temperature == 0.5 for _, c in children) and params.n == 3 and params.seed == 10
    assert child_params(SamplingParams(n=2), 1).seed is None
    with pytest.raises(ParameterError, match="^index"):
        parent.get_child_info(3)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_the_parent_reports_its_children_as_vllm_does(kind):
    """As they come, or all n in index order once the last has ended (FINAL_ONLY)."""
    parent = ParentRequest("p", SamplingParams(n=2, output_kind=kind))
    ids = [parent.get_child_info(i)[0] for i in range(2)]
    running, done = CompletionOutput(1, "a", [5]), CompletionOutput(1, "ab", [5, 6], finish_reason="length")
    first = CompletionOutput(0, "x", [7], finish_reason="stop")
    streamed = kind != RequestOutputKind.FINAL_ONLY
    assert parent.get_outputs(ids[1], running) == ([running] if streamed else [], False)
    assert parent.get_outputs(ids[1], done) == ([done] if streamed else [], False)
    assert parent.get_outputs(ids[0], first) == ([first] if streamed else [first, done], True)


@pytest.mark.parametrize("kw, name", [({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"n": 2, "seed": 2**64 - 1}, "seed")])
def test_bad_n_is_refused_by_name(kw, name):
    with pytest.raises(ParameterError, match=f"^{name} "):
        SamplingParams(**kw)


def test_the_n_children_share_the_prompts_full_blocks(tiny_llama_dir):
    engine = tiny_llm(tiny_llama_dir).llm_engine
    bm = engine.block_manager
    engine.add_request(PROMPT, SAMPLED, request_id="p")
    first = engine.scheduler.requests["0_p"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["0_p"]  # 1_p..3_p are parked
    assert engine.get_stats()["num_requests_waiting"] == 4
    outs = engine.step()  # child 0 computes the prompt and samples its first token
    assert [(o.request_id, o.outputs[0].index, o.num_cached_tokens) for o in outs] == [("p", 0, 0)]
    outs = engine.step()  # the other three join, each computing its last partial block only
    children = [engine.scheduler.requests[f"{i}_p"] for i in range(4)]
    shared = first.block_table[:5]
    # 03_prefix_cache/README.md draws these tables (a fresh pool hands out blocks 0, 1, 2, ...).
    assert [c.block_table for c in children] == [[0, 1, 2, 3, 4, own] for own in (5, 6, 7, 8)]
    assert [bm.blocks[b].ref_count for b in shared] == [4] * 5
    # Used blocks: 5 shared + each child's own (its partial prompt block and its tokens since).
    own = {c.request_id: len(c.block_table) - 5 for c in children}
    assert own == {c.request_id: cdiv(c.num_tokens - 1, BLOCK) - 5 for c in children}
    assert len(bm.used_block_ids) == 5 + sum(own.values())
    assert sorted((o.outputs[0].index, o.num_cached_tokens) for o in outs) == [(0, 0), (1, FULL), (2, FULL), (3, FULL)]
    outs += run(engine)
    finished = sorted((c.index, o.request_id) for o in outs for c in o.outputs if c.finished())
    assert finished == [(0, "p"), (1, "p"), (2, "p"), (3, "p")]
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished, "the parent ends once"
    assert engine.output_processor.parent_requests == {} and engine.output_processor.request_states == {}
    bm.check_invariants()
    assert bm.all_blocks_free()


def test_prompt_tokens_count_per_child_as_vllm_and_hits_match(tiny_llama_dir):
    engine = tiny_llm(tiny_llama_dir).llm_engine
    engine.add_request(PROMPT, SAMPLED, request_id="p")
    run(engine)
    stats = engine.get_stats()
    assert stats["prompt_tokens_total"] == 4 * len(PROMPT)
    assert stats["prefix_cache_hits"] == 3 * FULL
    # What the forwards computed of the prompts: once the whole prompt, three times its tail.
    assert stats["prompt_tokens_total"] - stats["prefix_cache_hits"] == len(PROMPT) + 3 * (len(PROMPT) - FULL)


def test_each_seeded_completion_is_the_n1_request_with_its_derived_seed(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    (out,) = llm.generate([PROMPT], SAMPLED, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1, "seeds 7..10 should not all sample alike"
    again = llm.generate([PROMPT], SAMPLED, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples
    singles = llm.generate([PROMPT] * 4, [child_params(SAMPLED, i) for i in range(4)], use_tqdm=False)
    assert [s["token_ids"] for s in singles] == samples
    assert out["text"] == out.outputs[0].text and out["token_ids"] == samples[0]
    assert out.num_cached_tokens == 0  # completion 0's: it computed the prompt
    assert_no_leak(llm)


def test_greedy_n_gives_n_copies_of_transformers_greedy(tiny_qwen3_dir):
    llm = tiny_llm(tiny_qwen3_dir)
    prompts = make_prompts(32, (19, 4))
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=GREEDY.max_tokens)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert [c.token_ids for c in out.outputs] == [hf_greedy(tiny_qwen3_dir, tuple(prompt))] * 3
    assert_no_leak(llm)


def test_offline_api_returns_n_outputs_in_index_order_with_prompt_logprobs_once(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    params = SamplingParams(n=3, seed=1, max_tokens=4, prompt_logprobs=1, logprobs=0)
    single = SamplingParams(seed=1, max_tokens=4, prompt_logprobs=1, logprobs=0)
    out, ref = llm.generate([PROMPT, PROMPT], [params, single], use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[1:] == ref.prompt_logprobs[1:]
    assert out.outputs[0].token_ids == ref["token_ids"]
    assert_no_leak(llm)


def test_aborting_the_parent_with_parked_children_frees_every_block(tiny_llama_dir):
    engine = tiny_llm(tiny_llama_dir).llm_engine
    engine.add_request(PROMPT, SAMPLED, request_id="p")
    assert engine.abort_request("p")
    outs = engine.step()
    ends = sorted((o.request_id, c.index, c.finish_reason) for o in outs for c in o.outputs)
    assert ends == [("p", i, "abort") for i in range(4)]
    assert not engine.has_unfinished_requests() and engine.output_processor.parent_requests == {}
    engine.block_manager.check_invariants()
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks
    # Aborted while the children ran and held the shared blocks.
    engine.add_request(PROMPT, SAMPLED, request_id="q")
    engine.step(), engine.step()
    assert engine.block_manager.blocks[engine.scheduler.requests["1_q"].block_table[0]].ref_count == 4
    assert engine.abort_request("q")
    assert not engine.abort_request("q")  # nothing left to stop
    assert sum(o.outputs[0].finish_reason == "abort" for o in engine.step()) == 4
    engine.block_manager.check_invariants()
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks


def test_a_parents_id_and_its_childrens_are_taken_while_it_runs(tiny_llama_dir):
    engine = tiny_llm(tiny_llama_dir).llm_engine
    engine.add_request([5, 6, 7], SamplingParams(n=2), request_id="p")
    for rid in ("p", "1_p"):
        with pytest.raises(ParameterError, match=f"^request_id '{rid}' is already in use"):
            engine.add_request([5], SamplingParams(), request_id=rid)
    engine.add_request([5], SamplingParams(), request_id="0_x")
    with pytest.raises(ParameterError, match="^request_id '0_x' is already in use .its completions run as"):
        engine.add_request([5], SamplingParams(n=2), request_id="x")


@pytest.mark.parametrize(
    "feature",
    [
        {"num_kvcache_blocks": 14},  # preemption: 4 children of up to 8 blocks each
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
        {"enable_prefix_caching": False},
        {"scheduling_policy": "priority"},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["preemption", "chunked_prefill", "no_prefix_caching", "priority", "spec_decode"],
)
def test_n_composes_with_engine_features(tiny_llama_dir, feature):
    """Greedy completions are all transformers' greedy, whatever runs underneath."""
    kw = {"enable_chunked_prefill": False, **feature}
    llm = tiny_llm(tiny_llama_dir, **kw)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=20, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    expected = hf_greedy(tiny_llama_dir, tuple(PROMPT), 20)
    assert [c.token_ids for c in out.outputs] == [expected] * 4
    stats = llm.llm_engine.get_stats()
    if "num_kvcache_blocks" in feature:
        assert stats["num_preemptions_total"] > 0, "the cache was meant to be too small"
    if "speculative_config" in feature:
        assert stats["spec_decode_num_draft_tokens"] > 0
    assert_no_leak(llm)


def test_n_composes_with_the_kv_pool(tiny_llama_dir):
    """Child 0 loads the prompt from the pool; the others then hit it in the local cache."""
    llm = tiny_llm(tiny_llama_dir, kv_transfer_config={"kv_connector": "embedded", "kv_role": "kv_both"})
    llm.generate([PROMPT], GREEDY, use_tqdm=False)  # computes and publishes the prompt
    assert llm.llm_engine.block_manager.reset_prefix_cache()
    (out,) = llm.generate([PROMPT], SamplingParams(n=3, temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [hf_greedy(tiny_llama_dir, tuple(PROMPT), 8)] * 3
    stats = llm.llm_engine.get_stats()
    assert stats["kv_pool_loaded_blocks"] == 5
    assert_no_leak(llm)


def test_async_stream_ends_after_the_last_completion(tiny_llama_dir):
    engine = tiny_llm(tiny_llama_dir).llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    async_llm = AsyncLLM(engine)
    async_llm.start()

    async def collect() -> list[RequestOutput]:
        stream = await async_llm.add_request("r", PROMPT, params)
        return [out async for out in stream]

    try:
        outs = asyncio.run(asyncio.wait_for(collect(), timeout=120))
    finally:
        async_llm.shutdown()
    assert {o.request_id for o in outs} == {"r"} and all(len(o.outputs) == 1 for o in outs)
    completions = [o.outputs[0] for o in outs]
    assert sorted(c.index for c in completions if c.finished()) == [0, 1, 2]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    tokens = {i: [c.token_ids for c in completions if c.index == i] for i in range(3)}
    assert all([len(ids) for ids in t] == [1, 2, 3, 4, 5] for t in tokens.values()), "records hold all so far"
