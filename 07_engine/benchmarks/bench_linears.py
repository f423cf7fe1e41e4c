"""The model's linear layers alone, through each matmul path the engine could take, against this machine's floors.

A decode step of a few requests is mostly matrix-vector products: every weight read once for a
row or two. How close each path comes to reading the weights at memory speed decides a single
stream's speed; at 32 rows the same weights also cost real arithmetic. For every distinct weight
shape of the model as the engine lays it out (fused QKV and gate-up projections, the LM head),
this times one pass over as many weights of that shape as the model has (distinct tensors, so
they stream from memory as in a step) through:

* ``F.linear``: oneDNN packs the weight on every call;
* ``packed``: the weight packed once (``layers/prepacked.py``, the eager engine's path);
* ``graph small`` and ``graph large``: the linears compiled by inductor with the settings of the
  engine's two graphs (``compilation.GRAPHS``: its own C++ GEMM template, and oneDNN under
  inductor), weights frozen: the engine runs the first up to ``SMALL_BATCH_TOKENS`` tokens and
  the second above, or the engine's GEMM in both where it runs for the model's dtype
  (``compilation.template_graphs``). The line before each row count says which;
* ``bf16_gemm``: the engine's own GEMM (``layers/bf16_gemm.py``), which every bfloat16 matmul
  takes, eager and compiled, where the CPU has AVX-512 BF16 (only there is it timed);
* ``f32_gemm``: the engine's float32 GEMM (``layers/f32_gemm.py``), which every float32 matmul
  takes where the CPU has AVX2 and FMA (only there, and for ``--dtype float32``, is it timed).

Each cell is milliseconds per pass and, in brackets, the shape's floor over that time: the larger
of reading its weights at the measured read rate and its FLOP at the measured matmul rate
(``floors.py``, measured first in the same run). 100 % is the machine's limit; a shape whose
weights stay in the L3 cache can pass it.

A shape's weights together (20-106 MB of the default model's) can stay in a large L3 cache from
one pass to the next, which a step's 269 MB cannot. ``--step-order`` also times every weight once
in the order a forward and its LM head read them, layer after layer, through the eager paths
(``packed`` and the engine's GEMM): what a step's linears cost.

    .venv/bin/python 07_engine/benchmarks/bench_linears.py                    # rows 1 and 32
    .venv/bin/python 07_engine/benchmarks/bench_linears.py --rows 1 4 16 --json linears.json
    .venv/bin/python 07_engine/benchmarks/bench_linears.py --rows 1 16 32 --step-order
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from floors import Floors, best_seconds, measure_floors
from machine import add_quiet_arg, check_quiet, load_average, machine_line
from vllm_from_scratch import default_model_dir
from vllm_from_scratch.compilation import GRAPHS, graph_for, template_graphs
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.layers import bf16_gemm, f32_gemm
from vllm_from_scratch.layers.prepacked import PrepackableWeight, linear, pack_weight
from vllm_from_scratch.model_runner import ModelRunner

REPEATS = 10
METHODS = ("F.linear", "packed", "graph small", "graph large", "bf16_gemm", "f32_gemm")


def methods_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The paths of :data:`METHODS` this machine runs for weights of ``dtype``: the engine's GEMM
    of that dtype only where it runs."""
    own_gemm = {torch.bfloat16: "bf16_gemm" if bf16_gemm.gemm_available() else None}
    own_gemm[torch.float32] = "f32_gemm" if f32_gemm.gemm_available() else None
    return tuple(m for m in METHODS if m not in ("bf16_gemm", "f32_gemm") or m == own_gemm.get(dtype))


class Linears(nn.Module):
    """``x`` through every weight in turn, as a graph to compile: one output per weight."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in weights])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [F.linear(x, w) for w in self.weights]


def engine_weight_order(model_dir: str, dtype: str) -> list[tuple[int, int]]:
    """The ``(out, in)`` shape of every weight the engine multiplies, as its layers hold them, in
    the order a forward and its LM head read them."""
    runner = ModelRunner(EngineConfig(model_dir, device="cpu", dtype=dtype, enforce_eager=True, warm_up=False))
    return [tuple(m.weight.shape) for m in runner.model.modules() if isinstance(m, PrepackableWeight)]


def engine_weight_shapes(model_dir: str, dtype: str) -> Counter[tuple[int, int]]:
    """``{(out, in): count}`` of the weights the engine multiplies."""
    return Counter(engine_weight_order(model_dir, dtype))


def matmul_paths(weights: list[torch.Tensor], x: torch.Tensor) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """One pass of ``x`` over ``weights`` through each path of :func:`methods_for` their dtype, as
    calls to time: the same products every time (``test_bench_linears.py`` checks that they agree)."""
    paths = {"F.linear": lambda: [F.linear(x, w) for w in weights], **eager_paths(weights, lambda w: x)}
    for method, graph in (("graph small", "small"), ("graph large", "large")):
        compiled = torch.compile(Linears(weights).eval(), options=GRAPHS[graph])

        def run(compiled: Callable = compiled) -> list[torch.Tensor]:
            # Freezing (which the C++ template needs, or it finds no choice for the matmul) applies
            # to graphs run without autograd, and through the config: given in torch.compile's
            # ``options`` it did not take effect here.
            with torch.no_grad(), torch._inductor.config.patch(freezing=True):
                return compiled(x)

        paths[method] = run
    return {method: paths[method] for method in methods_for(weights[0].dtype)}


def eager_paths(
    weights: list[torch.Tensor], x_for: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """One pass over ``weights``, weight ``w`` times ``x_for(w)``, through the eager paths of
    :func:`methods_for` their dtype: ``packed`` and the engine's GEMM where it runs."""
    rows = x_for(weights[0]).shape[0]
    packed = [pack_weight(w, rows) for w in weights]
    paths = {"packed": lambda: [linear(x_for(w), w, packed=p) for w, p in zip(weights, packed)]}
    for name, gemm in (("bf16_gemm", bf16_gemm), ("f32_gemm", f32_gemm)):
        if name in methods_for(weights[0].dtype):
            own = [gemm.pack(w) for w in weights]

            def run(gemm: ModuleType = gemm, own: list[torch.Tensor] = own) -> list[torch.Tensor]:
                return [gemm.linear(x_for(w), p, None, w.shape[0]) for w, p in zip(weights, own)]

            paths[name] = run
    return paths


def step_order_paths(weights: list[torch.Tensor], rows: int) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """:func:`eager_paths` for ``rows`` rows over ``weights`` whose inputs may differ in width: one
    input per width."""
    generator = torch.Generator().manual_seed(0)
    widths = sorted({w.shape[1] for w in weights})
    xs = {k: torch.randn(rows, k, generator=generator).to(weights[0].dtype) for k in widths}
    return eager_paths(weights, lambda w: xs[w.shape[1]])


def time_step_order(
    order: list[tuple[int, int]], rows_list: list[int], dtype: torch.dtype, floors: Floors
) -> list[dict]:
    """For each row count: the seconds of one pass over fresh weights of ``order``'s shapes through
    each of :func:`step_order_paths`, and their floor."""
    generator = torch.Generator().manual_seed(1)
    weights = [(torch.randn(shape, generator=generator) * 0.02).to(dtype) for shape in order]
    results = []
    for rows in rows_list:
        paths = step_order_paths(weights, rows)
        seconds = {method: best_seconds(fn, REPEATS, warm_calls=2) for method, fn in paths.items()}
        floor = sum(floor_seconds(floors, shape, 1, rows, weights[0].element_size()) for shape in order)
        results.append({"rows": rows, "floor_s": floor, "seconds": seconds})
    return results


def print_step_order(results: list[dict], megabytes: float) -> None:
    """One line per row count: each path's milliseconds for a step's linears and, in brackets, the
    floor over that time."""
    print(f"every weight once, in a step's order ({megabytes:.1f} MB); load {load_average()}")
    for r in results:
        cells = "".join(f"  {m} {s * 1e3:.2f} ms [{r['floor_s'] / s:4.0%}]" for m, s in r["seconds"].items())
        print(f"{r['rows']:>4} rows{cells}")


def time_methods(weights: list[torch.Tensor], rows: int) -> dict[str, float]:
    """Seconds of one pass of ``rows`` rows over ``weights`` through each of :func:`matmul_paths`."""
    torch._dynamo.reset()
    x = torch.randn(rows, weights[0].shape[1], generator=torch.Generator().manual_seed(0)).to(weights[0].dtype)
    # Two untimed calls: a graph compiles on the first; the second is the compiled code's first run.
    return {method: best_seconds(fn, REPEATS, warm_calls=2) for method, fn in matmul_paths(weights, x).items()}


def floor_seconds(floors: Floors, shape: tuple[int, int], count: int, rows: int, element_size: int) -> float:
    """The larger of reading ``count`` weights of ``shape`` and multiplying ``rows`` rows by them."""
    out_features, in_features = shape
    read = count * out_features * in_features * element_size / floors.read_bytes_per_s
    matmul = count * 2.0 * rows * out_features * in_features / floors.gemm_flop_per_s
    return max(read, matmul)


def print_table(
    results: list[dict], row_counts: list[int], element_size: int, own_gemm: str | None, templates: frozenset[str]
) -> None:
    """One line per weight shape and row count, and a line for all the shapes together: the
    milliseconds of each path and, in brackets, the floor over that time; before each row count,
    which graph the compiled engine runs it through, and whether its matmuls are the engine's GEMM
    ``own_gemm`` (None: none runs here) or, in the graphs of ``templates``
    (:func:`compilation.template_graphs`), inductor's."""
    methods = list(results[0]["seconds"])
    print(f"ms per pass over the weights of a shape [its floor over that time]; load {load_average()}")
    header = f"{'rows':>4}  {'weight shape':<13} {'count':>5}  {'MB':>6}" + "".join(f"  {m:>17}" for m in methods)
    print(header + "\n" + "-" * len(header))
    for rows in row_counts:
        graph = graph_for(rows)
        through = f", through {own_gemm}" if own_gemm and graph not in templates else ""
        print(f"{rows} rows: the compiled engine runs its {graph} graph{through}")
        mine = [r for r in results if r["rows"] == rows]
        lines = [
            (
                f"{r['shape'][0]} x {r['shape'][1]}",
                r["shape"][0] * r["shape"][1] * r["count"],
                r["count"],
                r["floor_s"],
                r["seconds"],
            )
            for r in mine
        ]
        lines.append(
            (
                "all",
                sum(line[1] for line in lines),
                sum(line[2] for line in lines),
                sum(line[3] for line in lines),
                {m: sum(line[4][m] for line in lines) for m in methods},
            )
        )
        for name, params, count, floor_s, seconds in lines:
            cells = "".join(f"  {seconds[m] * 1e3:8.2f} [{floor_s / seconds[m]:4.0%}]" for m in methods)
            print(f"{rows:>4}  {name:<13} {count:>5}  {params * element_size / 1e6:>6.1f}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype (default: bfloat16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="rows per matmul (default: 1 32)")
    parser.add_argument(
        "--step-order", action="store_true", help="also time every weight once in a step's order (eager paths)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    add_quiet_arg(parser)
    args = parser.parse_args()
    if args.threads < 1 or min(args.rows) < 1:
        parser.error("--threads and --rows must be >= 1")
    torch.set_num_threads(args.threads)
    model_dir = str(args.model or default_model_dir())
    order = engine_weight_order(model_dir, args.dtype)
    shapes = Counter(order)
    dtype = getattr(torch, args.dtype)
    check_quiet(args.refuse_busy)
    floors = measure_floors(model_dir, dtype)
    print(machine_line())
    print(floors.describe())
    results = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape, count in tqdm(sorted(shapes.items()), desc="shapes"):
            weights = [(torch.randn(shape, generator=generator) * 0.02).to(dtype) for _ in range(count)]
            for rows in args.rows:
                seconds = time_methods(weights, rows)
                floor = floor_seconds(floors, shape, count, rows, weights[0].element_size())
                results.append(
                    {"shape": list(shape), "count": count, "rows": rows, "floor_s": floor, "seconds": seconds}
                )
    config = EngineConfig(model_dir, device="cpu", dtype=args.dtype)
    own_gemm = "f32_gemm" if dtype == torch.float32 and f32_gemm.gemm_available() else None
    if "bf16_gemm" in methods_for(dtype):
        own_gemm = "bf16_gemm"
    print_table(results, args.rows, dtype.itemsize, own_gemm, template_graphs(config))
    report = {"machine": machine_line(), "floors": floors.as_json(), "results": results}
    if args.step_order:
        with torch.inference_mode():
            report["step_order"] = time_step_order(order, args.rows, dtype, floors)
        print_step_order(report["step_order"], sum(o * i for o, i in order) * dtype.itemsize / 1e6)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
