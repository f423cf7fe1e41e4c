"""vLLM's metrics: the families, labels and buckets of vLLM 0.32 (against a copy of its own
``/metrics``), every panel of vLLM's Grafana dashboards fed after a short load, the values of
the per-request families, and ``LLM.get_metrics()``'s records.

The server runs in-process (FastAPI's TestClient) on the real engine with a tiny random Llama
and token-id prompts: a few requests, a few seconds.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import test_server_protocol
from test_parallel_sampling import PROMPT, tiny_llm
from test_server_protocol import ScriptedEngine
from vllm_from_scratch.api_server import build_app
from vllm_from_scratch.engine import LLMEngine
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.metrics import VLLM_FAMILIES_NOT_EXPOSED, EngineMetrics
from vllm_from_scratch.metrics_reader import Counter, Gauge, Histogram, Vector
from vllm_from_scratch.sampling_params import SamplingParams

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
VLLM_METRICS = DASHBOARDS / "vllm-0.32-metrics.txt"  # vLLM 0.32's /metrics after a short load
SERVING_PAGE = Path(__file__).resolve().parents[1] / "topics" / "serving.md"
MODEL = "tiny"
# Grafana's variables, as a dashboard user would pick them for this server.
VARIABLES = {"$model_name": MODEL, "$Deployment_id": MODEL}
HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")
tokenizer = test_server_protocol.tokenizer


# ---- the families, as vLLM 0.32 exposes them ------------------------------------------------------


def families(text: str) -> dict[str, tuple[str, set[str], list[str]]]:
    """Prometheus text to ``{family: (type, label names, histogram upper bounds)}``."""
    found = {}
    for family in text_string_to_metric_families(text):
        names = {k for s in family.samples for k in s.labels if k != "le"}
        bounds = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        found[family.name] = (family.type, names, list(dict.fromkeys(bounds)))
    return found


def test_families_labels_and_buckets_are_vllms():
    """Every family of vLLM 0.32's /metrics (a default server, max_model_len 2048) is exposed
    with its type, label names and buckets, or listed with the reason it has no meaning here."""
    vllm = {k: v for k, v in families(VLLM_METRICS.read_text()).items() if k.startswith("vllm:")}
    stats = {"kv_pool_hit_tokens": 0}  # an engine with a KV pool: every family it can show
    ours = families(
        EngineMetrics("m", lambda: stats, max_model_len=2048, cache_config={"block_size": 16}).render().decode()
    )
    assert set(vllm) - set(ours) == set(VLLM_FAMILIES_NOT_EXPOSED) & set(vllm)
    for name in set(vllm) & set(ours):
        kind, labels, bounds = vllm[name]
        if name == "vllm:cache_config_info":  # the CacheConfig fields that have a meaning here
            assert ours[name][0] == kind and ours[name][1] <= labels
            continue
        assert ours[name] == (kind, labels, bounds), name
    assert not set(VLLM_FAMILIES_NOT_EXPOSED) & set(ours)
    page = SERVING_PAGE.read_text()
    assert all(f"`{name}`" in page for name in VLLM_FAMILIES_NOT_EXPOSED), "the serving page says why"


# ---- the server, after a short load -----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """/metrics of a server on the real engine after a few requests: two completions of one
    prompt (the second finds it cached), one streamed, and probes the http_* families leave out."""
    engine = LLMEngine(
        tiny_llama_dir, kvcache_block_size=8, num_kvcache_blocks=64, dtype="float32", enforce_eager=True, warm_up=False
    )
    with TestClient(build_app(engine, MODEL)) as client:
        for body in (
            {"prompt": PROMPT, "max_tokens": 4, "n": 2, "ignore_eos": True},
            {"prompt": PROMPT[:20], "max_tokens": 3, "stream": True, "ignore_eos": True},
        ):
            assert client.post("/v1/completions", json=body).status_code == 200
        assert client.get("/health").status_code == 200
        yield client.get("/metrics").text


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The series selectors of a PromQL expression: ``(metric name, [(label, op, value)])``.
    Ranges, grouping clauses, string values and function calls are set aside first."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    found = []
    for match in re.finditer(r"(?<![\w:$.])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?", expr):
        follows = expr[match.end() :].lstrip()
        if follows.startswith("(") or match.group(1) in ("by", "without", "bool", "and", "or", "unless", "offset"):
            continue  # a function or an operator
        matchers = re.findall(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"', match.group(2) or "")
        found.append((match.group(1), matchers))
    return found


def test_selectors_parse_promql():
    expr = (
        'histogram_quantile(0.99, sum by(le, model_name) (rate(vllm:x_bucket{model_name=~"$m"}[5m]))) / '
        "sum(increase(vllm:y_count[$__range])) + vllm:z"
    )
    assert selectors(expr) == [("vllm:x_bucket", [("model_name", "=~", "$m")]), ("vllm:y_count", []), ("vllm:z", [])]


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every target of every panel (rows' panels included), and
    the variables' ``label_values(metric, label)`` queries."""
    board = json.loads(path.read_text())
    queries = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            queries.extend((panel.get("title", ""), t["expr"]) for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(board["panels"])
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else str(query or "")
        for metric, label in re.findall(r"label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)", query):
            queries.append((f"variable {variable['name']}", f'{metric}{{{label}=~".+"}}'))
    return queries


def matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        for variable, chosen in VARIABLES.items():
            value = value.replace(variable, chosen)
        have = labels.get(label, "")
        ok = re.fullmatch(value, have) if op in ("=~", "!~") else have == value
        if bool(ok) != (op in ("=", "=~")):
            return False
    return True


@pytest.mark.parametrize("board", ["grafana.json", "performance_statistics.json", "query_statistics.json"])
def test_every_dashboard_panel_finds_its_series(served, board):
    """Each selector of each panel finds a series, and a counter or histogram one that has counted."""
    samples = [s for family in text_string_to_metric_families(served) for s in family.samples]
    queries = dashboard_queries(DASHBOARDS / board)
    assert len(queries) >= 10
    for title, expr in queries:
        for name, matchers in selectors(expr):
            found = [s for s in samples if s.name == name and matches(s.labels, matchers)]
            assert found, f"{board} / {title}: no series for {name}{matchers}"
            if name.endswith(("_total", *HISTOGRAM_PARTS)):
                assert any(s.value > 0 for s in found), f"{board} / {title}: {name} never counted"


def test_http_and_process_families_as_vllm(served):
    text = served
    for family in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info", "python_gc_objects"):
        assert f"\n{family}" in text, family
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 2.0' in text
    assert 'http_request_duration_seconds_count{handler="/v1/completions",method="POST"}' in text
    assert 'handler="/health"' not in text, "vLLM leaves probes and the scrape out"


def test_disable_log_stats_leaves_the_process_and_http_families(tokenizer):
    engine = ScriptedEngine(tokenizer)
    engine.config = SimpleNamespace(**vars(engine.config), disable_log_stats=True)
    with TestClient(build_app(engine, MODEL)) as client:
        assert client.post("/v1/completions", json={"prompt": [10, 11], "max_tokens": 2}).status_code == 200
        text = client.get("/metrics").text
    assert "vllm:" not in text and engine.stat_logger is None
    assert "\nprocess_cpu_seconds_total" in text and "\nhttp_requests_total{" in text


# ---- the per-request families' values, offline -----------------------------------------------------


def value(llm, name: str, **labels: str) -> float:
    """A counter's or gauge's value, or a histogram's (count, sum)."""
    for m in llm.get_metrics():
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()):
            return (m.count, m.sum) if isinstance(m, Histogram) else m.value
    raise AssertionError(f"{name}{labels} not in get_metrics()")


def test_a_preemption_counts_in_the_engine_and_in_the_request(tiny_llama_dir):
    """Three requests whose K/V outgrows 12 blocks of 8: the newest are preempted and recomputed."""
    llm = tiny_llm(tiny_llama_dir, num_kvcache_blocks=12, disable_log_stats=False, enable_prefix_caching=False)
    llm.generate(
        [PROMPT[:24], PROMPT[1:25], PROMPT[2:26]], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    preemptions = value(llm, "vllm:num_preemptions")
    assert preemptions > 0
    assert value(llm, "vllm:request_num_preemptions") == (3, preemptions), "each preemption is one request's"


def test_cached_prompt_tokens_count_with_prefix_caching(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, disable_log_stats=False)
    first, second = (llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40  # its 5 full blocks
    assert value(llm, "vllm:prompt_tokens_cached") == 40
    assert value(llm, "vllm:prompt_tokens_by_source", source="local_cache_hit") == 40
    assert value(llm, "vllm:prompt_tokens_by_source", source="local_compute") == 2 * len(PROMPT) - 40
    assert value(llm, "vllm:prompt_tokens_cached_by_source", source="device") >= 40
    assert value(llm, "vllm:request_prefill_kv_computed_tokens") == (2, 2 * len(PROMPT) - 40)


def test_n_and_max_tokens_are_observed_per_request_and_per_completion(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, disable_log_stats=False)
    params = [SamplingParams(n=3, max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True)]
    llm.generate([PROMPT, PROMPT[:9]], params, use_tqdm=False)
    assert value(llm, "vllm:request_params_n") == (2, 3 + 1), "once per request"
    assert value(llm, "vllm:request_max_num_generation_tokens") == (2, 5 + 7)
    assert value(llm, "vllm:request_params_max_tokens") == (4, 3 * 5 + 7), "once per completion"
    assert value(llm, "vllm:request_generation_tokens") == (4, 3 * 5 + 7)
    assert value(llm, "vllm:request_success", finished_reason="length") == 4
    n = next(m for m in llm.get_metrics() if m.name == "vllm:request_params_n")
    assert n.buckets == {"1.0": 1, "2.0": 1, "5.0": 2, "10.0": 2, "20.0": 2, "+Inf": 2}
    assert n.labels == {"model_name": tiny_llama_dir, "engine": "0"}


# (prompt length, n, max_tokens) per request; prompts share prefixes, so some hit the cache
WORKLOADS = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3), st.integers(1, 12)), min_size=1, max_size=5)


@pytest.mark.slow
@settings(max_examples=6, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload=WORKLOADS, num_blocks=st.sampled_from([12, 64]))
def test_the_families_agree_with_each_other_and_the_workload(tiny_llama_dir, workload, num_blocks):
    """Whatever the requests (and a KV cache small enough to preempt), each count adds up:
    by request, by completion, by token and by source; every preemption is one request's."""
    llm = tiny_llm(tiny_llama_dir, num_kvcache_blocks=num_blocks, disable_log_stats=False)
    prompts = [PROMPT[:length] for length, _, _ in workload]
    params = [SamplingParams(n=n, max_tokens=m, ignore_eos=True) for _, n, m in workload]
    llm.generate(prompts, params, use_tqdm=False)
    completions = sum(n for _, n, _ in workload)
    tokens = sum(n * m for _, n, m in workload)
    prompt_tokens = value(llm, "vllm:prompt_tokens")
    computed = value(llm, "vllm:prompt_tokens_by_source", source="local_compute")
    cached = value(llm, "vllm:prompt_tokens_by_source", source="local_cache_hit")
    assert prompt_tokens == sum(len(p) * n for p, (_, n, _) in zip(prompts, workload)) == computed + cached
    assert value(llm, "vllm:prompt_tokens_cached") == cached
    assert value(llm, "vllm:request_prefill_kv_computed_tokens") == (completions, computed)
    assert value(llm, "vllm:generation_tokens") == tokens
    assert value(llm, "vllm:request_generation_tokens") == (completions, tokens)
    assert value(llm, "vllm:request_params_max_tokens") == (completions, tokens)
    assert value(llm, "vllm:request_params_n") == (len(workload), completions)
    assert value(llm, "vllm:request_max_num_generation_tokens") == (len(workload), sum(m for _, _, m in workload))
    assert value(llm, "vllm:request_success", finished_reason="length") == completions
    assert value(llm, "vllm:time_to_first_token_seconds")[0] == completions
    assert value(llm, "vllm:inter_token_latency_seconds")[0] == tokens - completions  # one token a step
    assert value(llm, "vllm:iteration_tokens_total")[1] == computed + tokens
    assert value(llm, "vllm:request_num_preemptions") == (completions, value(llm, "vllm:num_preemptions"))
    assert value(llm, "vllm:num_requests_running") == value(llm, "vllm:num_requests_waiting") == 0


STEP_S = 0.2  # each step made at least this slow, so a step's place shows in the clocks


def test_phases_of_a_chunked_prompt(tiny_llama_dir):
    """A prompt prefilled in three chunks (16, 16 and 11 tokens): queued for well under a step,
    prefilling across the two steps before its first token."""
    llm = tiny_llm(tiny_llama_dir, enable_chunked_prefill=True, max_num_batched_tokens=16, disable_log_stats=False)
    engine = llm.llm_engine
    step = engine.step

    def slow_step():
        outputs = step()
        time.sleep(STEP_S)
        return outputs

    engine.step = slow_step  # type: ignore[method-assign]
    llm.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert value(llm, "vllm:request_queue_time_seconds")[1] < STEP_S
    assert value(llm, "vllm:request_prefill_time_seconds")[1] >= 2 * STEP_S
    assert value(llm, "vllm:request_decode_time_seconds")[1] >= STEP_S
    assert value(llm, "vllm:time_to_first_token_seconds")[1] >= 2 * STEP_S


def test_get_metrics_records_are_vllms(tiny_llama_dir):
    """Gauges, counters, histograms, and the accepted drafts per position as a Vector."""
    # The model drafts for itself: greedy, nearly every draft is accepted.
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 2}
    llm = tiny_llm(tiny_llama_dir, speculative_config=spec, disable_log_stats=False)
    llm.generate([PROMPT[:8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    records = {m.name: m for m in llm.get_metrics()}
    assert [m.name for m in llm.llm_engine.get_metrics()] == [m.name for m in llm.get_metrics()], "vLLM's two ways"
    assert isinstance(records["vllm:num_requests_running"], Gauge)
    assert isinstance(records["vllm:generation_tokens"], Counter) and records["vllm:generation_tokens"].value == 8
    assert isinstance(records["vllm:e2e_request_latency_seconds"], Histogram)
    per_pos = records["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == 2
    drafts = value(llm, "vllm:spec_decode_num_drafts")
    assert drafts > 0 and drafts >= per_pos.values[0] >= per_pos.values[1] > 0
    assert sum(per_pos.values) == value(llm, "vllm:spec_decode_num_accepted_tokens")


def test_get_metrics_needs_log_stats(tiny_llama_dir):
    with pytest.raises(ParameterError, match="disable_log_stats"):
        tiny_llm(tiny_llama_dir).get_metrics()
