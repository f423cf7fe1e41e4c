"""Prometheus metrics with vLLM's names, labels and buckets, so dashboards written for ``vllm
serve`` work unchanged (vLLM's ``PrometheusStatLogger``).

Two kinds of family, as in vLLM. The engine's state and its cumulative counters (requests
running and waiting, KV-cache usage, prefix-cache queries and hits, tokens, preemptions) are
read from the latest ``get_stats()`` snapshot at scrape time: no second copy to drift. What
only a request's life shows (time to first token, its phases, its token counts, ``n``,
``max_tokens``, its preemptions) the engine reports as it happens, on its own thread, to
:class:`EngineMetrics`, which keeps vLLM's per-request record (``RequestStateStats``) and
observes the histograms. Every series carries vLLM's ``model_name``
(the served name) and ``engine`` (the engine's index, "0") labels. Each engine has its own
registry, not the process-global one, so two engines in one process do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")

# vLLM's buckets (vllm/v1/metrics/buckets.py), so histograms line up with its dashboards.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# inter-token latency and a request's mean time per output token
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
# a request's e2e latency and its phases: queue, prefill, decode, inference
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# vLLM's label values. A request waits for capacity in the scheduler's queue, or is deferred:
# the completions of an ``n`` > 1 request held back until completion 0's prompt is cached.
WAITING_REASONS = ("capacity", "deferred")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Where cached prompt tokens came from: the engine's own KV cache, or the global KV pool (a
# remote store: vLLM's "external_unspecified"). The engine has no host, disk or p2p tier.
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
FINISH_REASONS = ("stop", "length", "abort", "error")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


# vLLM 0.32's families that the engine does not expose, and why (07_engine/topics/serving.md
# shows them beside the rest). The first six vLLM exposes on every server; the others only when
# a setting asks for them.
VLLM_FAMILIES_NOT_EXPOSED = {
    "vllm:admission_rejections": "the server has no admission queue limit (vLLM's --max-num-queued-reqs, "
    "--max-num-queued-tokens): no request is refused for a full queue",
    "vllm:estimated_flops_per_gpu": "vLLM's analytic FLOPs estimate for GPU utilisation (MFU); its CPU build reports 0",
    "vllm:estimated_read_bytes_per_gpu": "the same estimate's memory reads; 0 on vLLM's CPU build",
    "vllm:estimated_write_bytes_per_gpu": "the same estimate's memory writes; 0 on vLLM's CPU build",
    "vllm:mm_cache_queries": "the engine takes text and token ids only: no multi-modal inputs to cache",
    "vllm:mm_cache_hits": "the same: no multi-modal cache",
    "vllm:corrupted_requests": "only with VLLM_COMPUTE_NANS_IN_LOGITS; a request whose logits are all NaN "
    "ends with finish reason 'error' here, counted in vllm:request_success",
    "vllm:watermark_requests": "only with a watermark_config: the engine has no watermarking",
    "vllm:lora_requests_info": "only with LoRA: the engine serves no adapters",
    "vllm:num_requests_kv_fetch_by_stage": "only for a KV consumer: the global KV pool loads synchronously at the "
    "start of the next step, so no load is ever in flight when /metrics is read",
    "vllm:kv_block_lifetime_seconds": "only with --kv-cache-metrics (sampled block residency); not built",
    "vllm:kv_block_idle_before_evict_seconds": "the same opt-in family",
    "vllm:kv_block_reuse_gap_seconds": "the same opt-in family",
}


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
    (
        "vllm:external_prefix_cache_queries",
        "kv_pool_query_tokens",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
        "queried tokens.",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "kv_pool_hit_tokens",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
        "cached tokens.",
    ),
    ("vllm:num_preemptions", "num_preemptions_total", "Cumulative number of preemption from the engine."),
    ("vllm:prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
)
# The global KV pool's own counters, present only when the engine has a KV connector. vLLM's
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


# vLLM's histograms: (name, help, buckets); None is the 1-2-5 series of token counts up to
# max_model_len. A request's phases (vLLM's): queued from its arrival in the engine to its first
# scheduling, prefill from then to its first token, decode from there to its last; inference is
# prefill + decode.
HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...] | None], ...] = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", None),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS),
    (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        None,
    ),
    ("vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", None),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        ITL_BUCKETS,
    ),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        REQUEST_NUM_PREEMPTIONS_BUCKETS,
    ),
    (
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        None,
    ),
)


class SchedulerStatsCollector(Collector):
    """Turns the engine's ``get_stats()`` snapshot into gauges and counters at scrape time."""

    def __init__(
        self,
        get_stats: Callable[[], Mapping[str, Any]],
        labels: tuple[str, str],
        cache_config: Mapping[str, object],
        num_speculative_tokens: int | None,
    ):
        self.get_stats = get_stats
        self.labels = list(labels)
        self.cache_config = {key: str(value) for key, value in cache_config.items()}
        self.num_speculative_tokens = num_speculative_tokens

    def _gauge(self, name: str, doc: str, extra: str | None = None) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[*LABELS, *([extra] if extra else [])])

    def _counter(self, name: str, doc: str, extra: str | None = None) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=[*LABELS, *([extra] if extra else [])])

    def collect(self) -> Iterable[Metric]:
        stats = self.get_stats()
        labels = self.labels
        for name, key, doc in GAUGES:
            gauge = self._gauge(name, doc)
            gauge.add_metric(labels, float(stats.get(key, 0)))
            yield gauge
        deferred = float(stats.get("num_requests_deferred", 0))
        by_reason = self._gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = the completions of an n > 1 request held back until its first completion's prompt is "
            "cached. Sum of all reasons equals vllm:num_requests_waiting.",
            "reason",
        )
        waiting = float(stats.get("num_requests_waiting", 0))
        for reason, count in zip(WAITING_REASONS, (waiting - deferred, deferred)):
            by_reason.add_metric([*labels, reason], count)
        yield by_reason
        pool = KV_POOL_COUNTERS if "kv_pool_hit_tokens" in stats else ()
        for name, key, doc in COUNTERS + pool:
            counter = self._counter(name, doc)
            counter.add_metric(labels, float(stats.get(key, 0)))
            yield counter
        cached = self._counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (the engine's KV cache) or "
            "external_unspecified (the global KV pool). Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            "source",
        )
        supplied = {
            "device": stats.get("prefix_cache_hits", 0),
            "external_unspecified": stats.get("kv_pool_hit_tokens", 0),
        }
        for source in CACHE_HIT_SOURCES:
            cached.add_metric([*labels, source], float(supplied.get(source, 0)))
        yield cached
        yield from self._spec_decode(stats)
        sleep = self._gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "sleep_state",
        )
        level = int(stats.get("sleep_level", 0))
        for state, value in zip(SLEEP_STATES, (level == 0, level == 1, level == 2)):
            sleep.add_metric([*labels, state], float(value))
        yield sleep
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self.cache_config, "engine"],
        )
        info.add_metric([*self.cache_config.values(), labels[1]], 1.0)
        yield info

    def _spec_decode(self, stats: Mapping[str, Any]) -> Iterable[Metric]:
        """vLLM's speculative-decoding counters, present only with a ``speculative_config``."""
        if self.num_speculative_tokens is None:
            return
        for name, key, doc in (
            ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
            ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
            ),
        ):
            counter = self._counter(name, doc)
            counter.add_metric(self.labels, float(stats.get(key, 0)))
            yield counter
        per_pos = self._counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", "position"
        )
        accepted = stats.get("spec_decode_num_accepted_tokens_per_pos", ())
        for pos in range(self.num_speculative_tokens):
            per_pos.add_metric([*self.labels, str(pos)], float(accepted[pos] if pos < len(accepted) else 0))
        yield per_pos


@dataclass
class RequestStateStats:
    """One core request's record (vLLM's): when it arrived (``time.time()``, as
    ``EngineCoreRequest.arrival_time``) and, on the engine's monotonic clock, when the engine
    queued it, first scheduled it, and when it got its first and its latest token; its prompt,
    what of it was cached, and how often it was preempted."""

    arrival_time: float
    queued_ts: float
    num_prompt_tokens: int
    max_tokens: int | None
    parent_id: str | None
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class ParentStats:
    """An ``n`` > 1 request: its ``n``, its completions still running, and the most tokens one
    of them generated (vLLM's ``request_max_num_generation_tokens``)."""

    n: int
    num_unfinished: int
    max_num_generation_tokens: int = 0


class EngineMetrics:
    """Every ``vllm:`` family of one engine, in its own registry (see the module docstring).

    ``get_stats`` gives the engine's snapshot at scrape time (the server's copy, taken on the
    engine's thread); ``cache_config`` the labels of ``vllm:cache_config_info``;
    ``num_speculative_tokens`` (k) turns on the speculative-decoding counters; ``registry``
    (default: a new one) is where the families go: the server's holds its HTTP and process
    families too.
    """

    def __init__(
        self,
        model_name: str,
        get_stats: Callable[[], Mapping[str, Any]],
        max_model_len: int = 4096,
        cache_config: Mapping[str, object] | None = None,
        num_speculative_tokens: int | None = None,
        engine_index: int = 0,
        registry: CollectorRegistry | None = None,
    ):
        self.model_name = model_name
        self.labels = (model_name, str(engine_index))
        self.registry = CollectorRegistry() if registry is None else registry
        self.registry.register(
            SchedulerStatsCollector(get_stats, self.labels, cache_config or {}, num_speculative_tokens)
        )
        self.requests: dict[str, RequestStateStats] = {}
        self.parents: dict[str, ParentStats] = {}

        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            LABELS,
            registry=self.registry,
        ).labels(*self.labels)
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*LABELS, "source"],
            registry=self.registry,
        )
        self.prompt_tokens_by_source = {s: by_source.labels(*self.labels, s) for s in PROMPT_TOKEN_SOURCES}
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        tokens = one_two_five_buckets(max_model_len)
        self.histograms = {
            name: Histogram(name, doc, LABELS, buckets=buckets or tokens, registry=self.registry).labels(*self.labels)
            for name, doc, buckets in HISTOGRAMS
        }

    # ---- the engine's thread reports a request's life ----------------------------------------

    def request_added(
        self,
        request_id: str,
        arrival_time: float,
        num_prompt_tokens: int,
        max_tokens: int | None,
        parent_id: str | None = None,
        n: int = 1,
    ) -> None:
        """A core request joined (one of the ``n`` completions of ``parent_id`` when ``n`` > 1)."""
        parent_id = parent_id if n > 1 else None
        self.requests[request_id] = RequestStateStats(
            arrival_time, time.monotonic(), num_prompt_tokens, max_tokens, parent_id
        )
        if parent_id is not None and parent_id not in self.parents:
            self.parents[parent_id] = ParentStats(n, n)

    def request_scheduled(self, request_id: str, num_preemptions: int, now: float) -> None:
        """A step scheduled ``request_id``, preempted ``num_preemptions`` times so far; the first
        such step ends its wait in the queue."""
        stats = self.requests.get(request_id)
        if stats is not None:
            stats.num_preemptions = num_preemptions
            if stats.scheduled_ts == 0.0:
                stats.scheduled_ts = now

    def request_loaded(self, request_id: str, num_tokens: int) -> None:
        """``num_tokens`` of ``request_id``'s prompt came from the global KV pool."""
        stats = self.requests.get(request_id)
        if stats is not None:
            stats.num_external_cached_tokens += num_tokens

    def step_tokens(self, new_tokens: Iterable[tuple[str, int, int]], now: float, wall_now: float) -> None:
        """One step's tokens, ``(request_id, num_new_tokens, num_cached_tokens)`` per request that
        sampled. A request's first tokens end its prefill: its prompt counts then, by source
        (vLLM's rule), and the step's tokens are the prompts it completed plus the new tokens."""
        step_total = 0
        for request_id, num_new, num_cached in new_tokens:
            stats = self.requests.get(request_id)
            if stats is None or num_new == 0:
                continue
            step_total += num_new
            if stats.num_generation_tokens == 0:
                stats.num_cached_tokens = num_cached
                external = min(stats.num_external_cached_tokens, num_cached)
                computed = stats.num_prompt_tokens - num_cached
                step_total += computed
                self.prompt_tokens_by_source["local_compute"].inc(computed)
                self.prompt_tokens_by_source["local_cache_hit"].inc(num_cached - external)
                self.prompt_tokens_by_source["external_kv_transfer"].inc(external)
                self.prompt_tokens_cached.inc(num_cached)
                self.observe("vllm:time_to_first_token_seconds", wall_now - stats.arrival_time)
                stats.first_token_ts = now
            else:
                self.observe("vllm:inter_token_latency_seconds", now - stats.last_token_ts)
            stats.last_token_ts = now
            stats.num_generation_tokens += num_new
        if step_total:
            self.observe("vllm:iteration_tokens_total", step_total)

    def request_finished(self, request_id: str, finish_reason: str, wall_now: float) -> None:
        """``request_id`` ended: its count by reason, and (unless aborted or failed) its histograms.
        A request reported twice (an abort, then the step that reports it) counts once."""
        stats = self.requests.pop(request_id, None)
        if stats is None:
            return
        self.request_success[finish_reason].inc()
        parent = self.parents.get(stats.parent_id) if stats.parent_id is not None else None
        if parent is not None:
            parent.num_unfinished -= 1
            parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, stats.num_generation_tokens)
            if parent.num_unfinished == 0:
                del self.parents[stats.parent_id]  # type: ignore[arg-type]
        if finish_reason in ("abort", "error"):
            return
        if parent is None or parent.num_unfinished == 0:  # once per request, when its last completion ends
            self.observe("vllm:request_params_n", 1 if parent is None else parent.n)
            most = stats.num_generation_tokens if parent is None else parent.max_num_generation_tokens
            self.observe("vllm:request_max_num_generation_tokens", most)
        self.observe("vllm:e2e_request_latency_seconds", wall_now - stats.arrival_time)
        self.observe("vllm:request_prompt_tokens", stats.num_prompt_tokens)
        self.observe("vllm:request_generation_tokens", stats.num_generation_tokens)
        self.observe("vllm:request_prefill_kv_computed_tokens", stats.num_prompt_tokens - stats.num_cached_tokens)
        self.observe("vllm:request_num_preemptions", stats.num_preemptions)
        if stats.max_tokens is not None:
            self.observe("vllm:request_params_max_tokens", stats.max_tokens)
        if stats.scheduled_ts == 0.0 or stats.first_token_ts == 0.0:
            return  # it never ran: no phases to time
        decode = stats.last_token_ts - stats.first_token_ts
        self.observe("vllm:request_queue_time_seconds", stats.scheduled_ts - stats.queued_ts)
        self.observe("vllm:request_prefill_time_seconds", stats.first_token_ts - stats.scheduled_ts)
        self.observe("vllm:request_decode_time_seconds", decode)
        self.observe("vllm:request_inference_time_seconds", stats.last_token_ts - stats.scheduled_ts)
        num_decoded = stats.num_generation_tokens - 1  # the prefill's token is no decode's
        self.observe("vllm:request_time_per_output_token_seconds", decode / num_decoded if num_decoded > 0 else 0.0)

    def observe(self, name: str, value: float) -> None:
        """Observe ``value`` in histogram ``name`` (one of :data:`HISTOGRAMS`)."""
        self.histograms[name].observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
