"""Chapter 03's global KV pool as the engine's KV connector, in one process (the embedded pool).

An engine whose local prefix cache forgot a prompt loads it from the pool instead of computing
it, and produces exactly the tokens transformers does; faults (a value gone, a value corrupt)
are computed instead; roles decide who loads and who publishes; nothing leaks. The real
Mooncake store across processes is ``test_kv_connector_mooncake.py``.
"""

from __future__ import annotations

import warnings

import pytest

from test_engine_parity import BLOCK, GREEDY, MAX_TOKENS, assert_no_leak, hf_greedy, make_prompts
from vllm_from_scratch import LLM
from vllm_from_scratch.errors import ParameterError

SHARED = make_prompts(21, (40,))[0]  # 5 blocks of 8


def pooled_llm(model_dir, role="kv_both", **kw) -> LLM:
    return LLM(
        model_dir,
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        dtype="float32",
        kv_transfer_config={"kv_connector": "embedded", "kv_role": role},
        **kw,
        enforce_eager=True,
    )


def prompts_sharing_a_prefix(n=3):
    return [SHARED + tail for tail in make_prompts(22, (3, 6, 11)[:n])]


def forget_local_cache(llm: LLM) -> None:
    assert llm.llm_engine.block_manager.reset_prefix_cache()


def test_a_forgotten_prefix_is_loaded_from_the_pool_with_identical_output(tiny_llama_dir):
    llm = pooled_llm(tiny_llama_dir)
    prompts = prompts_sharing_a_prefix()
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # computes and publishes the prefix
    forget_local_cache(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_llama_dir, tuple(p)) for p in prompts]
    # The shared 40 tokens came from the pool (the last prompt token is always computed), loaded
    # once: the two requests admitted beside the first waited a step and hit the local cache.
    assert [o["num_cached_tokens"] for o in outs] == [40, 40, 40]
    stats = llm.llm_engine.get_stats()
    assert stats["kv_pool_loaded_blocks"] == 5 and stats["kv_pool_load_failures"] == 0
    assert stats["kv_pool_hit_tokens"] == 40 and stats["kv_pool_saved_blocks"] > 0
    assert stats["prefix_cache_hits"] >= 2 * 40
    assert_no_leak(llm)


def test_metrics_count_the_pool_only_where_there_is_one(tiny_llama_dir):
    from vllm_from_scratch.metrics import EngineMetrics

    llm = pooled_llm(tiny_llama_dir)
    llm.generate([SHARED + [7]], GREEDY, use_tqdm=False)
    forget_local_cache(llm)
    llm.generate([SHARED + [9]], GREEDY, use_tqdm=False)
    text = EngineMetrics("m", llm.llm_engine.get_stats).render().decode()
    block_bytes = llm.llm_engine.executor.runner.kv_worker.block_bytes
    assert 'vllm:kv_pool_hits_total{engine="0",model_name="m"} 40.0' in text
    assert f'vllm:kv_pool_loaded_bytes_total{{engine="0",model_name="m"}} {5.0 * block_bytes}' in text
    assert 'vllm:kv_pool_load_failures_total{engine="0",model_name="m"} 0.0' in text
    plain = LLM(tiny_llama_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=64, dtype="float32", enforce_eager=True)
    assert "kv_pool" not in EngineMetrics("m", plain.llm_engine.get_stats).render().decode()


def test_the_request_waits_for_remote_kvs_then_runs(tiny_llama_dir):
    from scheduler import RequestStatus

    llm = pooled_llm(tiny_llama_dir)
    engine = llm.llm_engine
    llm.generate([SHARED + [7]], GREEDY, use_tqdm=False)
    forget_local_cache(llm)
    engine.add_request(SHARED + [9], GREEDY, request_id="r")
    req = engine.scheduler.requests["r"]
    assert engine.step() == [] and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.block_table and req.num_computed_tokens == 0  # blocks held, K/V not there yet
    engine.step()  # the load lands, then the request computes its last token and samples
    assert req.status == RequestStatus.RUNNING and req.num_cached_tokens == 40
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(llm)


@pytest.mark.parametrize("fault", ["vanished", "corrupt"])
def test_a_bad_block_is_computed_never_used(tiny_llama_dir, fault):
    llm = pooled_llm(tiny_llama_dir)
    engine = llm.llm_engine
    prompt = prompts_sharing_a_prefix(1)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    forget_local_cache(llm)
    engine.add_request(prompt, GREEDY, request_id="r")
    engine.step()  # admitted: waiting for its K/V, the pool promised 5 blocks
    pool = engine.executor.runner.kv_worker.pool
    third = pool.block_key(engine.block_manager.block_hashes(engine.scheduler.requests["r"])[2])
    if fault == "vanished":
        pool.backend.remove(third)  # evicted between the query and the load
    else:
        pool.backend._data[third] = pool.backend._data[third][:-7]  # truncated value
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while engine.has_unfinished_requests():
            outs += engine.step()
    assert any("recomputing" in str(w.message) for w in caught)
    assert outs[-1].outputs[0].token_ids == hf_greedy(tiny_llama_dir, tuple(prompt))
    assert outs[-1].num_cached_tokens == 2 * BLOCK  # the two blocks before the bad one
    assert engine.get_stats()["kv_pool_load_failures"] == 1
    assert_no_leak(llm)


def test_roles_decide_who_loads_and_who_publishes(tiny_llama_dir):
    prompt = prompts_sharing_a_prefix(1)[0]
    producer = pooled_llm(tiny_llama_dir, "kv_producer")
    producer.generate([prompt], GREEDY, use_tqdm=False)
    forget_local_cache(producer)
    producer.generate([prompt], GREEDY, use_tqdm=False)
    assert producer.llm_engine.get_stats()["kv_pool_loaded_blocks"] == 0  # a producer never loads
    # Every block that filled, prompt and output (the last sampled token is never fed), once.
    assert producer.llm_engine.get_stats()["kv_pool_saved_blocks"] == (len(prompt) + MAX_TOKENS - 1) // BLOCK

    consumer = pooled_llm(tiny_llama_dir, "kv_consumer")
    consumer.generate([prompt], GREEDY, use_tqdm=False)
    assert consumer.llm_engine.get_stats()["kv_pool_saved_blocks"] == 0  # a consumer never publishes


def test_an_aborted_request_waiting_for_its_kv_frees_its_blocks(tiny_llama_dir):
    llm = pooled_llm(tiny_llama_dir)
    engine = llm.llm_engine
    llm.generate([SHARED + [7]], GREEDY, use_tqdm=False)
    forget_local_cache(llm)
    engine.add_request(SHARED + [9], GREEDY, request_id="r")
    engine.step()
    assert engine.abort_request("r")
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    assert engine.kv_connector.take_pending_loads() == []
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "config, name",
    [
        ({"kv_connector": "redis"}, "kv_connector"),
        ({"kv_role": "kv_both"}, "kv_connector"),
        ({"kv_connector": "embedded", "kv_role": "both"}, "kv_role"),
        ({"kv_connector": "mooncake"}, "master_server_address"),
        ({"kv_connector": "embedded", "global_segment_size": -1}, "global_segment_size"),
        ({"kv_connector": "embedded", "protocol": "udp"}, "protocol"),
        ({"kv_connector": "embedded", "colour": "red"}, "colour"),
        ("mooncake", "kv_transfer_config"),
    ],
)
def test_bad_kv_transfer_config_names_the_key(tiny_llama_dir, config, name):
    with pytest.raises(ParameterError, match=name):
        LLM(tiny_llama_dir, kv_transfer_config=config, enforce_eager=True)


def test_the_pool_needs_the_prefix_cache(tiny_llama_dir):
    with pytest.raises(ParameterError, match="enable_prefix_caching"):
        LLM(
            tiny_llama_dir,
            kv_transfer_config={"kv_connector": "embedded"},
            enable_prefix_caching=False,
            enforce_eager=True,
        )


@pytest.mark.slow
def test_each_tensor_parallel_rank_loads_its_own_shard(tiny_llama_dir):
    llm = pooled_llm(tiny_llama_dir, tensor_parallel_size=2, device="cpu")
    try:
        prompts = prompts_sharing_a_prefix()
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        forget_local_cache(llm)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_llama_dir, tuple(p)) for p in prompts]
        assert [o["num_cached_tokens"] for o in outs] == [40, 40, 40]
        assert_no_leak(llm)
    finally:
        llm.shutdown()


def test_the_proxy_asks_for_the_api_key_as_the_server_does():
    from fastapi.testclient import TestClient

    from vllm_from_scratch.tools.disagg_proxy import build_proxy

    # Nothing listens on these ports: a request the key lets through fails upstream, not with 401.
    app = build_proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], api_key="sesame")
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        denied = client.post("/v1/completions", json=body)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}).status_code != 401
