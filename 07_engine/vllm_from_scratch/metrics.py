"""Prometheus metrics with vLLM's names, so dashboards written for ``vllm serve`` work unchanged.

The engine's state and cumulative counters are read from its latest ``get_stats()`` snapshot at
scrape time (no second copy to drift); per-request latencies are only visible to the server,
which observes them into histograms. Every metric carries vLLM's ``model_name`` label. The
registry is per server, not the process-global one, so two servers in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms line up with its dashboards.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# vLLM's request_latency_buckets: queue, prefill, decode and inference times.
REQUEST_TIME_BUCKETS = E2E_BUCKETS
# fmt: on
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``limit`` (token counts)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


# (vLLM name, get_stats() key, help). Gauges are read as they are; counters get "_total".
GAUGES = (
    ("vllm:num_requests_running", "num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_requests_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)
COUNTERS = (
    (
        "vllm:prefix_cache_queries",
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "num_preemptions_total", "Cumulative number of preemptions from the engine."),
)
# The global KV pool's counters, present only when the engine has a KV connector. vLLM's
# connectors each report their own; these follow its "queries / hits in tokens" convention.
KV_POOL_COUNTERS = (
    ("vllm:kv_pool_queries", "kv_pool_query_tokens", "KV pool queries, in terms of number of queried tokens."),
    ("vllm:kv_pool_hits", "kv_pool_hit_tokens", "KV pool hits, in terms of number of tokens found in the pool."),
    ("vllm:kv_pool_loaded_bytes", "kv_pool_loaded_bytes", "Bytes of KV loaded from the pool into the KV cache."),
    ("vllm:kv_pool_saved_bytes", "kv_pool_saved_bytes", "Bytes of KV published from the KV cache to the pool."),
    (
        "vllm:kv_pool_load_failures",
        "kv_pool_load_failures",
        "Pool loads that failed or failed their check (recomputed).",
    ),
)


class EngineStatsCollector(Collector):
    """Turns the engine's ``get_stats()`` snapshot into gauges and counters at scrape time."""

    def __init__(self, get_stats: Callable[[], dict], model_name: str):
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self.get_stats()
        for name, key, doc in GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(stats.get(key, 0)))
            yield gauge
        pool = KV_POOL_COUNTERS if "kv_pool_hit_tokens" in stats else ()
        for name, key, doc in COUNTERS + pool:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(stats.get(key, 0)))
            yield counter


class ServerMetrics:
    """The server's registry: engine-state collector plus request-latency histograms."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict], max_model_len: int = 4096):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))

        def histogram(name: str, what: str, buckets: tuple[float, ...], unit: str = " in seconds") -> Histogram:
            doc = f"Histogram of {what}{unit}."
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "time to first token", TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "inter-token latency", ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds", "e2e request latency", E2E_BUCKETS)
        # A request's phases (vLLM's): queued from arrival to its first scheduling, prefill from
        # then to its first token, decode from there to its last; inference is prefill + decode.
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds", "time spent in WAITING phase for request", REQUEST_TIME_BUCKETS
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "time spent in PREFILL phase for request", REQUEST_TIME_BUCKETS
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds", "time spent in DECODE phase for request", REQUEST_TIME_BUCKETS
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds", "time spent in RUNNING phase for request", REQUEST_TIME_BUCKETS
        )
        tokens = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "number of prefill tokens processed", tokens, unit=""
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "number of generation tokens processed", tokens, unit=""
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "the max_tokens request parameter", tokens, unit=""
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "number of tokens per engine_step", ITERATION_TOKEN_BUCKETS, unit=""
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def request_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
