"""The engine on the real Mooncake store: separate processes, prefill/decode disaggregation, faults.

Every test starts its own ``mooncake_master`` (and a ``mooncake_client`` holding the pool) on
free loopback ports and stops it; nothing outlives a test. Skipped only where the Mooncake
package cannot be imported. float32, so that tokens computed in a different batch shape agree
exactly with a plain instance.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import openai
import pytest

from mooncake_launcher import MooncakeClient, MooncakeMaster, mooncake_unavailable_reason
from server_testing import ServerProcess
from vllm_from_scratch import LLM, SamplingParams, default_model_dir

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.slow,
    pytest.mark.skipif(mooncake_unavailable_reason() is not None, reason=str(mooncake_unavailable_reason())),
]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture
def store():
    with MooncakeMaster() as master, MooncakeClient(master, segment_size="256 MB"):
        yield master


def pool_config(master, role: str) -> dict:
    return {
        "kv_connector": "mooncake",
        "kv_role": role,
        "master_server_address": master.master_addr,
        "metadata_server": master.metadata_url,
        "global_segment_size": 0,
    }


def engine(pool: dict | None = None) -> LLM:
    kw = {} if pool is None else {"kv_transfer_config": pool}
    # No warm-up: it times nothing here, and would run 34 dummy forwards in each of a test's engines.
    return LLM(
        default_model_dir(),
        dtype="float32",
        num_kvcache_blocks=128,
        max_model_len=512,
        **kw,
        enforce_eager=True,
        warm_up=False,
    )


def prompts(n=3, shared=96):
    system = list(range(1000, 1000 + shared))
    return [system + list(range(2000 + 10 * i, 2000 + 10 * i + 7)) for i in range(n)]


def test_a_second_process_is_served_from_the_pool(tmp_path):
    """The book's measurement, small: bench_engine_kv_pool.py's cold / producer / consumer processes."""
    out = tmp_path / "pool.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_engine_kv_pool.py"),
            "--dtype",
            "float32",
            "--requests",
            "3",
            "--shared-len",
            "64",
            "--distinct-len",
            "8",
            "--new-tokens",
            "4",
            "--enforce-eager",
            "--no-warm-up",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests_with_identical_tokens"] == 3
    assert report["producer"]["kv_pool_saved_blocks"] >= 4
    consumer = report["consumer"]
    # The 64 shared tokens, loaded once: the two requests arriving beside the first wait a step
    # for that load and find them in the local prefix cache.
    assert consumer["pool"]["kv_pool_loaded_blocks"] == 4
    assert consumer["prompt_tokens_computed"] < report["cold"]["prompt_tokens_computed"]
    assert "break-even" in proc.stdout


def test_disaggregated_prefill_and_decode_through_the_proxy(store):
    base = [
        "vllm_from_scratch.serve",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--num-kvcache-blocks",
        "128",
        "--log-level",
        "warning",
        "--enforce-eager",
        "--no-warm-up",
        "--kv-transfer-config",
    ]
    with (
        ServerProcess(base + [json.dumps(pool_config(store, "kv_producer"))]) as prefill,
        ServerProcess(base + [json.dumps(pool_config(store, "kv_consumer"))]) as decode,
        ServerProcess(
            ["vllm_from_scratch.tools.disagg_proxy", "--prefill", prefill.url, "--decode", decode.url]
        ) as proxy,
    ):
        direct = openai.OpenAI(base_url=prefill.url + "/v1", api_key="-", max_retries=0, timeout=120)
        via_proxy = openai.OpenAI(base_url=proxy.url + "/v1", api_key="-", max_retries=0, timeout=120)
        model = direct.models.list().data[0].id
        ask = dict(model=model, messages=CAPITAL, temperature=0, max_tokens=16)
        reference = direct.chat.completions.create(**ask)
        answer = via_proxy.chat.completions.create(**ask)
        assert answer.choices[0].message.content == reference.choices[0].message.content
        assert "Paris" in answer.choices[0].message.content
        # The decode instance computed only what the pool did not hold.
        assert answer.usage.prompt_tokens_details.cached_tokens >= 16
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in via_proxy.chat.completions.create(
                **{**ask, "messages": CAPITAL + [{"role": "user", "content": "And of Italy?"}]}, stream=True
            )
        )
        assert streamed


def test_the_engine_survives_the_master_dying(store):
    llm = engine(pool_config(store, "kv_both"))
    try:
        first = llm.generate(prompts(), GREEDY, use_tqdm=False)
        store.stop()
        llm.llm_engine.block_manager.reset_prefix_cache()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            again = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in again] == [o["token_ids"] for o in first]
        assert any("global KV pool" in str(w.message) for w in caught)
        assert time.monotonic() - start < 60  # one store timeout, not one per request
        assert llm.llm_engine.block_manager.all_blocks_free()
    finally:
        llm.shutdown()


def test_a_producer_killed_while_publishing_costs_nothing_but_time(store, tmp_path):
    script = tmp_path / "producer.py"
    script.write_text(
        "from test_kv_connector_mooncake import GREEDY, engine, prompts\n"
        f"llm = engine({pool_config(store, 'kv_producer')!r})\n"
        "print('READY', flush=True)\n"
        "while True:\n"
        "    llm.generate(prompts(8, shared=320), GREEDY, use_tqdm=False)\n"
    )
    producer = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert producer.stdout.readline().strip() == "READY"
        time.sleep(2.0)  # mid-run: some blocks published, some being published
    finally:
        producer.kill()
        producer.wait()
    plain = engine()
    reference = plain.generate(prompts(8, shared=320), GREEDY, use_tqdm=False)
    consumer = engine(pool_config(store, "kv_consumer"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = consumer.generate(prompts(8, shared=320), GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in reference]
        assert consumer.llm_engine.block_manager.all_blocks_free()
    finally:
        consumer.shutdown()
