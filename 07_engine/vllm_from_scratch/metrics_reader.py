"""``LLM.get_metrics()``'s records: vLLM's ``vllm.v1.metrics.reader`` types, read from a registry.

Each ``vllm:`` series becomes one record: a :class:`Counter` or :class:`Gauge` with its value, a
:class:`Histogram` with its count, sum and cumulative buckets by upper bound (``"+Inf"``
included), or a :class:`Vector` for the one family vLLM reads as a list: the accepted draft
tokens per position, ``vllm:spec_decode_num_accepted_tokens_per_pos``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample

PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """One series: its family's name and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """Integer counters by position (``values[i]`` is position ``i``'s)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: ``buckets`` maps each upper bound (``"+Inf"`` last) to the
    cumulative count at or under it; ``count`` is the ``"+Inf"`` bucket's, ``sum`` the total."""

    count: int
    sum: float
    buckets: dict[str, int]


def _key(sample: Sample, drop: str | None = None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in sample.labels.items() if k != drop))


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every ``vllm:`` series in ``registry`` now, as records (vLLM's ``get_metrics_snapshot``)."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        samples = family.samples
        if family.type == "gauge":
            collected += [Gauge(family.name, dict(s.labels), s.value) for s in samples]
        elif family.type == "counter":
            totals = [s for s in samples if s.name == family.name + "_total"]
            if family.name == PER_POSITION:
                by_series: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
                for s in totals:
                    by_series.setdefault(_key(s, "position"), {})[int(s.labels["position"])] = int(s.value)
                for key, by_pos in by_series.items():
                    values = [by_pos.get(pos, 0) for pos in range(max(by_pos) + 1)]
                    collected.append(Vector(family.name, dict(key), values))
            else:
                collected += [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
        elif family.type == "histogram":
            buckets: dict[tuple[tuple[str, str], ...], dict[str, int]] = {}
            counts: dict[tuple[tuple[str, str], ...], int] = {}
            sums: dict[tuple[tuple[str, str], ...], float] = {}
            for s in samples:
                if s.name == family.name + "_bucket":
                    buckets.setdefault(_key(s, "le"), {})[s.labels["le"]] = int(s.value)
                elif s.name == family.name + "_count":
                    counts[_key(s)] = int(s.value)
                elif s.name == family.name + "_sum":
                    sums[_key(s)] = s.value
            for key, by_bound in buckets.items():
                collected.append(Histogram(family.name, dict(key), counts[key], sums[key], by_bound))
        else:
            raise AssertionError(f"{family.name}: a {family.type} is not a vLLM metric type")
    return collected
