"""Re-run the book's benchmarks and draw the figures of the results page, in one command.

Each figure has a recipe below: the benchmark command (the same one its chapter's README
quotes), how to read the table it prints, and how to plot it. The benchmark's full output is
saved under ``docs/data/<name>.txt`` (with the command, the machine and the date on top), the
plot under ``docs/figures/<name>.png``, and ``docs/figures/figures.json`` lists what was drawn;
the site build puts every listed figure on the results page.

    python docs/make_figures.py                 # run every benchmark that exists, draw all
    python docs/make_figures.py --only scheduler_policies
    python docs/make_figures.py --from-data     # redraw from docs/data/ without re-running
    python docs/make_figures.py --list

A benchmark whose script is not in the repository (a chapter still being written) is skipped
and said so; its old figure, if any, stays listed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from tqdm import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
FIGURES = ROOT / "docs" / "figures"
MANIFEST = FIGURES / "figures.json"


# ---------------------------------------------------------------------------- reading tables
def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every ``| a | b |`` table in ``text`` (outer pipes optional), as rows of {header: cell}."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if "|" in line:
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 3 and set("".join(block[1])) <= set("-: "):
            header = block[0]
            tables.append([dict(zip(header, row)) for row in block[2:]])
        block = []
    return tables


def aligned_tables(text: str) -> list[list[dict[str, str]]]:
    """Tables whose columns are separated by two or more spaces (a header, then rows)."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if block and re.fullmatch(r"[-=|: ]+", line.strip()):
            continue  # a rule under the header
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 2 and not line.startswith(("I1", "W1", "E1")):
            block.append(cells)
            continue
        if len(block) >= 2:
            header = block[0]
            rows = [r for r in block[1:] if len(r) == len(header)]
            if rows:
                tables.append([dict(zip(header, r)) for r in rows])
        block = []
    return tables


def number(cell: str) -> float:
    """'1,234.5', '37 ms', '2.1x' -> a float; '-' or '' -> nan."""
    m = re.search(r"-?\d[\d,]*\.?\d*(e-?\d+)?", cell or "")
    return float(m.group(0).replace(",", "")) if m else float("nan")


# ---------------------------------------------------------------------------- recipes
@dataclass
class Recipe:
    """One figure: the benchmark that feeds it and how to draw what it prints."""

    name: str
    chapter: str
    title: str
    caption: str
    command: list[str]
    plot: Callable[[str, plt.Axes], None]
    timeout_s: int = 900

    @property
    def script(self) -> Path:
        return ROOT / self.command[0]


def _bars(ax: plt.Axes, labels: list[str], series: dict[str, list[float]], ylabel: str, log: bool = False):
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt=lambda v: f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}", fontsize=7)
    ax.set_xticks(range(len(labels)), [textwrap.fill(label, 14) for label in labels], fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot_scheduler_policies(output: str, ax: plt.Axes) -> None:
    table = markdown_tables(output)[0]
    metrics = ["TTFT mean ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "ITL max ms"]
    series = {row["policy"]: [number(row[m]) for m in metrics] for row in table}
    _bars(ax, [m.replace(" ms", "") for m in metrics], series, "simulated ms (lower is better)")


def plot_kv_pool(output: str, ax: plt.Axes) -> None:
    table = next(t for t in aligned_tables(output) if "operation" in t[0])
    cols = [c for c in table[0] if c.endswith("blocks/s")]
    labels = [row["operation"] for row in table]
    series = {c.replace(" blocks/s", ""): [number(row[c]) for row in table] for c in cols}
    _bars(ax, labels, series, "KV blocks per second (log)", log=True)


def plot_engine_throughput(output: str, ax: plt.Axes) -> None:
    table = next(t for t in markdown_tables(output) + aligned_tables(output) if any("tok/s" in k for k in t[0]))
    label_col = next(iter(table[0]))
    value_col = next(k for k in table[0] if "tok/s" in k)
    labels = [row[label_col] for row in table]
    _bars(ax, labels, {value_col: [number(row[value_col]) for row in table]}, "output tokens / s")


def plot_engine_kv_pool(output: str, ax: plt.Axes) -> None:
    tables = markdown_tables(output)
    cold, pooled = next(t for t in tables if "instance" in t[0])
    single, disaggregated = next(t for t in tables if "setup" in t[0])
    labels = [
        "pool: TTFT mean",
        "pool: TTFT p99",
        "pool: prefill of all 16",
        "P/D: TTFT mean",
        "P/D: ITL p50",
        "P/D: ITL p99",
    ]
    series = {
        "without (cold instance / one instance)": [
            number(cold[c]) for c in ("TTFT mean s", "TTFT p99 s", "their prefill s")
        ]
        + [number(single[c]) / 1000 for c in ("TTFT mean ms", "ITL p50 ms", "ITL p99 ms")],
        "with (prefix from the pool / prefill + decode pair)": [
            number(pooled[c]) for c in ("TTFT mean s", "TTFT p99 s", "their prefill s")
        ]
        + [number(disaggregated[c]) / 1000 for c in ("TTFT mean ms", "ITL p50 ms", "ITL p99 ms")],
    }
    _bars(ax, labels, series, "seconds (log, lower is better)", log=True)
    ax.legend(fontsize=8, loc="lower left")


def plot_chunked_prefill(output: str, ax: plt.Axes) -> None:
    table = markdown_tables(output)[0]
    metrics = ["long prompt TTFT ms", "decode ITL p50 ms", "decode ITL p99 ms", "decode ITL max ms"]
    series = {row["mode"]: [number(row[m]) for m in metrics] for row in table}
    _bars(ax, [m.replace(" ms", "") for m in metrics], series, "wall ms (log, lower is better)", log=True)


def plot_spec_decode(output: str, ax: plt.Axes) -> None:
    table = next(t for t in markdown_tables(output) if "proposer" in t[0])
    labels = [f"{r['workload']}\n{r['proposer']}" + (f" k={r['k']}" if r["k"] != "0" else "") for r in table]
    series = {
        "tokens per target forward": [number(r["tokens/forward"]) for r in table],
        "speed-up over plain decoding": [number(r["speed-up"]) for r in table],
    }
    _bars(ax, labels, series, "x (higher is better)")
    ax.axhline(1.0, color="gray", linewidth=0.8)


RECIPES = [
    Recipe(
        "scheduler_policies",
        "04_scheduler",
        "Two-phase (vLLM V1) vs prefill-first (nano-vllm) scheduling",
        "The same 200 requests (prompts 32-512 tokens, outputs 16-256, one every 80 ms on "
        "average) on chapter 04's fake model; a step costs a simulated 10 ms + 0.05 ms per "
        "token. Time to first token and inter-token latency per policy.",
        ["04_scheduler/compare_policies.py"],
        plot_scheduler_policies,
    ),
    Recipe(
        "kv_pool",
        "03_prefix_cache",
        "Global KV pool: embedded dict vs the Mooncake store",
        "One SmolLM2-135M KV block (360 KiB bf16) per operation, Mooncake over loopback TCP with "
        "a master and a pool-holding client started by the benchmark. Log scale.",
        ["03_prefix_cache/bench_kv_pool.py", "--repeat", "100"],
        plot_kv_pool,
    ),
    Recipe(
        "spec_decode",
        "05_spec_decode",
        "Speculative decoding on the default model: tokens per forward and speed-up",
        "SmolLM2-135M-Instruct (float32, greedy, batch 1, 32 new tokens) as the target; an "
        "n-gram proposer and a draft model made of the target's first 4 layers, k = 4; a prompt "
        "the model copies and an open-ended one. Speed-up is wall time of plain decoding over "
        "speculative decoding on the same code path.",
        ["05_spec_decode/bench_spec_decode.py", "--max-new-tokens", "32", "--ks", "4", "--draft-ks", "4"],
        plot_spec_decode,
        timeout_s=1800,
    ),
    Recipe(
        "chunked_prefill",
        "06_chunked_prefill",
        "Chunked prefill: decodes keep their pace while a long prompt arrives",
        "Four requests decoding on chapter 06's toy transformer when a 2,048-token prompt "
        "arrives; without chunking it runs in one step, with chunking in 256-token pieces "
        "beside the decodes. Wall-clock medians of 3 runs, 1 torch thread. Log scale.",
        ["06_chunked_prefill/bench_chunked_prefill.py"],
        plot_chunked_prefill,
    ),
    Recipe(
        "engine_kv_pool",
        "07_engine",
        "The engine on a shared Mooncake pool: a second instance, and prefill/decode disaggregation",
        "SmolLM2-135M-Instruct, dtype auto (bfloat16 here), KV blocks of 16 tokens, one Mooncake "
        "master and pool client on loopback TCP. Pool: 16 requests sharing a 1,000-token system "
        "prompt (+32 own tokens, 8 new) on a fresh instance, cold or loading the prefix another "
        "instance published. P/D: 24 requests at 1/s (prompts 256-768 tokens, 32-64 new) on one "
        "instance with both cores, or a prefill and a decode instance with one core each behind "
        "the proxy.",
        ["07_engine/benchmarks/bench_engine_kv_pool.py", "--pd", "--json", "docs/data/engine_kv_pool.json"],
        plot_engine_kv_pool,
        timeout_s=1800,
    ),
    Recipe(
        "engine_throughput",
        "07_engine",
        "The engine vs transformers' generate on the default model",
        "SmolLM2-135M-Instruct in bfloat16 on the CPU, the same seeded serving-shaped workload for "
        "both: 128 requests, prompts of 32-256 random tokens, 16-256 new tokens each, greedy, "
        "ignore_eos. The engine takes them all at once (continuous batching); transformers runs "
        "left-padded static batches of 16, 32, 64 and 128, one after another. Throughput = "
        "requested output tokens / wall time.",
        [
            "07_engine/benchmarks/bench.py",
            *"--dtype bfloat16 --hf-dtypes bfloat16 --hf-batch-sizes 16 32 64 128".split(),
        ],
        plot_engine_throughput,
        timeout_s=1800,
    ),
]


# ---------------------------------------------------------------------------- running
def machine() -> str:
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "torch missing"
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {gpu}, Python {platform.python_version()}{load}"


def run_benchmark(recipe: Recipe) -> str:
    """Run the recipe's command; save and return its output (with a provenance header)."""
    cmd = [sys.executable, *map(str, recipe.command)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MC_LOG_LEVEL="ERROR")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=recipe.timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(recipe.command)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    header = (
        f"# command: python {' '.join(recipe.command)}\n# machine: {machine()}\n"
        f"# date: {datetime.datetime.now().isoformat(timespec='seconds')}\n"
    )
    text = header + proc.stdout
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / f"{recipe.name}.txt").write_text(text)
    return text


def draw(recipe: Recipe, output: str) -> dict:
    fig, ax = plt.subplots(figsize=(8, 4))
    recipe.plot(output, ax)
    ax.set_title(recipe.title, fontsize=10)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURES / f"{recipe.name}.png", dpi=120)
    plt.close(fig)
    provenance = dict(line.split(": ", 1) for line in output.splitlines()[:3] if line.startswith("# ") and ": " in line)
    return {
        "name": recipe.name,
        "chapter": recipe.chapter,
        "title": recipe.title,
        "caption": recipe.caption,
        "image": f"figures/{recipe.name}.png",
        "command": provenance.get("# command", "python " + " ".join(recipe.command)),
        "machine": provenance.get("# machine", ""),
        "date": provenance.get("# date", ""),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="draw only this figure (repeatable)")
    parser.add_argument(
        "--from-data", action="store_true", help="redraw from the outputs saved in docs/data/ instead of re-running"
    )
    parser.add_argument("--list", action="store_true", help="list the figures and their commands")
    args = parser.parse_args(argv)
    if args.list:
        for r in RECIPES:
            print(f"{r.name:<22} {r.chapter:<18} python {' '.join(r.command)}")
        return 0
    manifest = {f["name"]: f for f in json.loads(MANIFEST.read_text())} if MANIFEST.exists() else {}
    chosen = [r for r in RECIPES if not args.only or r.name in args.only]
    failed = []
    for recipe in tqdm(chosen, desc="figures"):
        data_file = DATA / f"{recipe.name}.txt"
        if args.from_data:
            if not data_file.exists():
                tqdm.write(f"skip {recipe.name}: no {data_file.relative_to(ROOT)}")
                continue
            output = data_file.read_text()
        elif not recipe.script.exists():
            tqdm.write(f"skip {recipe.name}: {recipe.command[0]} is not in the repository yet")
            continue
        else:
            try:
                output = run_benchmark(recipe)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                tqdm.write(f"FAILED {recipe.name}: {exc}")
                failed.append(recipe.name)
                continue
        manifest[recipe.name] = draw(recipe, output)
        tqdm.write(f"drew docs/figures/{recipe.name}.png")
    order = [r.name for r in RECIPES]
    FIGURES.mkdir(parents=True, exist_ok=True)
    MANIFEST.write_text(
        json.dumps(
            sorted(manifest.values(), key=lambda f: order.index(f["name"]) if f["name"] in order else len(order)),
            indent=2,
        )
        + "\n"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
