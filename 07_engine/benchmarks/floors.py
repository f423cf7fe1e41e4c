"""The machine's own floors, measured in the same run as the benchmark they judge.

A tok/s figure from one VM says little about another of the same label: memory and matmul speed
differ between hosts and between days (performance.md's tables moved 1.7x from one day to the
next). What carries over is the *fraction of the floor*: how close a system comes to what this
machine's memory and matmul units allow for the work it was given, measured minutes apart.

Two floors bound a generation workload from below, in time:

* **memory**: every decode step reads every weight once (one stream's step is a matrix-vector
  product per linear). A workload whose longest request generates ``T`` tokens takes at least
  ``T`` steps, so ``T * weight_bytes / read_bandwidth`` seconds. Measured: the time to sum a
  buffer the size of the weights, in their dtype, with the benchmark's threads.
* **matmul**: every token forwarded costs ``2 * matmul_params`` FLOP in the decoder's linears and
  every sampled row ``2 * head_params`` in the LM head (attention, norms and the rest are extra).
  Measured: the rate at the model's own weight shapes, ``GEMM_ROWS`` rows, in the model's dtype,
  of the faster at each shape of ``F.linear`` and the engine's own linear layer (its GEMM where
  the CPU runs one: on an AVX2 CPU in float32, at 2,048 rows, 10-30 % faster than ``F.linear``,
  whose rate alone would put the floor below what the machine does).

The floor of a workload is the larger of the two times; its output tokens over that time is the
most tok/s this machine could give, and ``measured / floor`` is what a table reports beside it.
A bench probes twice, before its timed runs and after them, and keeps each rate's faster probe
(``Floors.faster``): a floor probed in a slow minute would sit below what the machine then did.

    python 07_engine/benchmarks/floors.py                 # the default model's floors here
    python 07_engine/benchmarks/floors.py --dtype float32 --model DIR
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

# Rows of the matmul-rate probe: a prefill chunk's size, where a GEMM runs near its best rate.
GEMM_ROWS = 2048
# Best of this many timed repeats: the floor is what the machine *can* do; noise only slows it.
REPEATS = 5


@dataclass(frozen=True)
class ModelFootprint:
    """What one token costs a model: the parameters its linears multiply and the bytes a step reads.

    ``matmul_shapes`` are the decoder's 2-D weights (out, in), one entry per distinct shape with
    its count; ``head_params`` the LM head's (the embedding matrix when tied: counted once, since a
    step reads a single embedding row but the whole head)."""

    matmul_params: int
    head_params: int
    other_params: int
    matmul_shapes: dict[tuple[int, int], int]
    bytes_per_param: int

    @property
    def weight_bytes(self) -> int:
        return (self.matmul_params + self.head_params + self.other_params) * self.bytes_per_param


def model_footprint(model_dir: str | Path, dtype: torch.dtype) -> ModelFootprint:
    """Read the parameter shapes from ``model_dir``'s safetensors headers (no weights loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise ValueError(f"model_dir {model_dir} holds no *.safetensors file")
    head = next((n for n in ("lm_head.weight", "model.embed_tokens.weight") if n in shapes), None)
    if head is None:
        raise ValueError(f"model_dir {model_dir}: no lm_head.weight or model.embed_tokens.weight")
    matmul: dict[tuple[int, int], int] = {}
    other = 0
    for name, shape in shapes.items():
        if name == head:
            continue
        if ".layers." in name and name.endswith(".weight") and len(shape) == 2:
            matmul[(shape[0], shape[1])] = matmul.get((shape[0], shape[1]), 0) + 1
        elif name != "model.embed_tokens.weight":  # an untied embedding: one row read a step
            other += math.prod(shape)
    return ModelFootprint(
        matmul_params=sum(o * i * count for (o, i), count in matmul.items()),
        head_params=math.prod(shapes[head]),
        other_params=other,
        matmul_shapes=matmul,
        bytes_per_param=torch.empty((), dtype=dtype).element_size(),
    )


def best_seconds(fn: Callable[[], object], repeats: int, warm_calls: int = 1) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after ``warm_calls`` untimed ones (page
    faults, oneDNN's kernel choice, a compiled graph's first runs)."""
    for _ in range(warm_calls):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_read_bandwidth(nbytes: int, dtype: torch.dtype, repeats: int = REPEATS) -> float:
    """Bytes per second of summing an ``nbytes`` buffer of ``dtype``: reading it once from memory
    (the buffer is far larger than the caches for any real model)."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    buffer = torch.ones(max(1, nbytes // torch.empty((), dtype=dtype).element_size()), dtype=dtype)
    return buffer.numel() * buffer.element_size() / best_seconds(buffer.sum, repeats)


def linear_kernels(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ways this machine computes ``x @ weight.T``: ``F.linear`` (oneDNN or MKL) and the
    engine's own linear layer holding ``weight``, packed as the engine packs it after loading."""
    from vllm_from_scratch.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(weight.shape[1], weight.shape[0]).to(weight.dtype)
    layer.weight.data.copy_(weight)
    layer.prepack()
    return {"F.linear": lambda x: F.linear(x, weight), "the engine's linear": layer.matmul}


def measure_gemm_rate(
    shapes: dict[tuple[int, int], int], dtype: torch.dtype, rows: int = GEMM_ROWS, repeats: int = REPEATS
) -> float:
    """FLOP per second over ``rows`` rows at each (out, in) weight shape, weighted by how many
    weights have it (the model's own matmul mix), each shape timed with the fastest of its
    :func:`linear_kernels`."""
    if not shapes:
        raise ValueError("shapes must hold at least one (out, in) weight shape")
    flops = seconds = 0.0
    with torch.inference_mode():
        for (out_features, in_features), count in shapes.items():
            x = torch.randn(rows, in_features).to(dtype)
            kernels = linear_kernels(torch.randn(out_features, in_features).to(dtype)).values()
            seconds += count * min(best_seconds(lambda k=k, x=x: k(x), repeats) for k in kernels)
            flops += count * 2.0 * rows * in_features * out_features
    return flops / seconds


@dataclass(frozen=True)
class Floors:
    """This machine's measured rates and the model's footprint, as a table prints them."""

    read_bytes_per_s: float
    gemm_flop_per_s: float
    footprint: ModelFootprint
    probes: int = 1  # how many measurements each rate is the fastest of

    def faster(self, other: Floors) -> Floors:
        """Each rate the faster of this probe's and ``other``'s, of the same model on the same
        machine (a bench probes before and after its runs). A floor is the most the machine allows:
        a small VM's host slows one probe now and then, and a floor from that probe alone fell
        below what a system measured after it then reached (104 % of its floor)."""
        if other.footprint != self.footprint:
            raise ValueError("other: floors of another model or dtype, not a second probe of these")
        return Floors(
            read_bytes_per_s=max(self.read_bytes_per_s, other.read_bytes_per_s),
            gemm_flop_per_s=max(self.gemm_flop_per_s, other.gemm_flop_per_s),
            footprint=self.footprint,
            probes=self.probes + other.probes,
        )

    def seconds(self, prompt_tokens: int, output_tokens: int, num_requests: int, longest_output: int) -> dict:
        """The two floors of a workload, in seconds: ``memory`` (the longest request's decode
        steps, each reading every weight) and ``matmul`` (every forwarded token through the
        linears, every sampled row through the head)."""
        forwarded = prompt_tokens + output_tokens - num_requests  # a request's last token is never fed back
        flops = 2.0 * (self.footprint.matmul_params * forwarded + self.footprint.head_params * output_tokens)
        return {
            "memory": longest_output * self.footprint.weight_bytes / self.read_bytes_per_s,
            "matmul": flops / self.gemm_flop_per_s,
        }

    def tokens_per_s(self, prompt_tokens: int, output_tokens: int, num_requests: int, longest_output: int) -> float:
        """The most output tok/s this machine could give the workload: output tokens over the
        larger floor."""
        return output_tokens / max(self.seconds(prompt_tokens, output_tokens, num_requests, longest_output).values())

    def describe(self) -> str:
        probes = f" (the faster of {self.probes} probes, before and after the runs)" if self.probes > 1 else ""
        return (
            f"floors measured in this run{probes}: memory read {self.read_bytes_per_s / 1e9:.1f} GB/s over "
            f"{self.footprint.weight_bytes / 1e6:.0f} MB (the weights' size), matmul "
            f"{self.gemm_flop_per_s / 1e9:.0f} GFLOP/s at the model's shapes, {GEMM_ROWS} rows, the fastest "
            "kernel at each"
        )

    def as_json(self) -> dict:
        footprint = asdict(self.footprint)
        footprint["matmul_shapes"] = [[o, i, c] for (o, i), c in self.footprint.matmul_shapes.items()]
        return {
            "read_gb_per_s": round(self.read_bytes_per_s / 1e9, 2),
            "gemm_gflop_per_s": round(self.gemm_flop_per_s / 1e9, 1),
            "gemm_rows": GEMM_ROWS,
            "probes": self.probes,
            "weight_bytes": self.footprint.weight_bytes,
            "footprint": footprint,
        }


@dataclass(frozen=True)
class Target:
    """A tok/s bar for a system beside a peer measured in the same run: ``peer_speedup`` times the
    peer's tok/s and ``floor_fraction`` of the workload's floor, both (``need_both``) or the lower
    of the two. The lower one is the fair bar beside a peer already near the floor: a peer at 70 %
    of it leaves no system room to be 1.5x faster."""

    peer_speedup: float
    floor_fraction: float
    need_both: bool

    def tokens_per_s(self, peer_tps: float, floor_tps: float) -> float:
        """The tok/s that meets this target beside a peer of ``peer_tps`` under a floor of ``floor_tps``."""
        for name, value in (("peer_tps", peer_tps), ("floor_tps", floor_tps)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        bars = (self.peer_speedup * peer_tps, self.floor_fraction * floor_tps)
        return max(bars) if self.need_both else min(bars)

    def describe(self) -> str:
        joined = "and" if self.need_both else "or"
        which = "" if self.need_both else ", the lower"
        return f"{self.peer_speedup:g}x the peer {joined} {self.floor_fraction * 100:g} % of the floor{which}"


# The targets the performance page holds the engine to beside vLLM's CPU build.
SINGLE_STREAM_TARGET = Target(peer_speedup=1.5, floor_fraction=0.6, need_both=True)
THROUGHPUT_TARGET = Target(peer_speedup=1.5, floor_fraction=0.8, need_both=False)  # a batch, a server


def judge(tps: float, peer_tps: float, floor_tps: float, target: Target) -> dict:
    """``tps`` beside a peer's ``peer_tps`` under a floor of ``floor_tps``, as a report records it:
    the ratio, both fractions of the floor, the target's tok/s and whether ``tps`` reaches it."""
    bar = target.tokens_per_s(peer_tps, floor_tps)
    return {
        "ratio": round(tps / peer_tps, 3),
        "fraction_of_floor": [round(tps / floor_tps, 3), round(peer_tps / floor_tps, 3)],
        "target": target.describe(),
        "target_tokens_per_s": round(bar, 1),
        "target_met": tps >= bar,
    }


def measure_floors(model_dir: str | Path, dtype: torch.dtype, repeats: int = REPEATS) -> Floors:
    """Measure both rates for ``model_dir`` in ``dtype`` with this process's torch threads."""
    footprint = model_footprint(model_dir, dtype)
    return Floors(
        read_bytes_per_s=measure_read_bandwidth(footprint.weight_bytes, dtype, repeats),
        gemm_flop_per_s=measure_gemm_rate(footprint.matmul_shapes, dtype, repeats=repeats),
        footprint=footprint,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="the weights' dtype (default: the engine's on this CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the floors as JSON")
    args = parser.parse_args(argv)
    from machine import machine_line
    from vllm_from_scratch import default_model_dir
    from vllm_from_scratch.loader import resolve_dtype

    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    dtype = resolve_dtype(args.dtype, "cpu")
    floors = measure_floors(model_dir, dtype)
    print(machine_line())
    print(floors.describe())
    step = floors.footprint.weight_bytes / floors.read_bytes_per_s
    print(f"one stream's decode step reads every weight: >= {step * 1e3:.2f} ms, <= {1 / step:.1f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(floors.as_json(), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
