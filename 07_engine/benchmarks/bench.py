"""Throughput of the engine against transformers' ``generate`` on the same model and workload.

CPU (default): the embedded SmolLM2-135M-Instruct and a fixed seeded serving-shaped workload:
128 requests, prompts of 32-256 random token ids, 16-256 new tokens each, greedy, ignore_eos.
The engine takes them all at once (continuous batching, up to ``--max-num-seqs``);
transformers runs them in static batches, left-padded, one batch after another, at every batch
size of ``--hf-batch-sizes`` (and dtype of ``--hf-dtypes``): the ratio is taken against the
*best* of those runs, so the baseline is tuned, not a strawman. ``--num-requests 32
--output-len 64 128 --hf-batch-sizes 32`` is the small workload of earlier runs (one batch:
nothing for continuous batching to exploit).

``--gpu``: nano-vllm's bench.py workload (256 sequences, input and output lengths uniform in
[100, 1024], temperature 0.6, ignore_eos) on a random checkpoint shaped like Qwen3-0.6B, built
with transformers (no hub; a small tokenizer is trained beside it), eager and with CUDA graphs,
on the engine, on nano-vllm itself, run from its source (``--nano-vllm DIR``, found at
``shared/peers/nano-vllm`` where it exists, and only where flash-attn imports) by
``nanovllm_peer_runner.py`` on the same prompts, and on transformers' ``generate`` (greedy, at
each of ``--hf-batch-sizes``); the ratio columns are against the best of each peer.

Throughput counts the tokens that were asked for (sum of max_tokens) over wall time, for both
sides: transformers pads every request of a batch to the longest output, and that waste is its
cost, not extra throughput. Both sides run in this process with the same ``torch`` thread count
(``--threads``); the machine's load average is printed with the table, because other processes
on a shared CPU slow both sides, and not always equally. ``--json PATH`` also writes the table
(and the workload, threads and load) for the docs' figures.

``--peer vllm`` adds vLLM's CPU build on the same workload (same prompts and output lengths,
greedy, ignore_eos, the engine's dtype), run by ``vllm_peer_runner.py`` in vLLM's own virtualenv
(``07_engine/benchmarks/make_vllm_venv.sh`` builds it): once at vLLM's defaults, which bind one core for
compute and reserve the other for its front end, and once with every usable core bound. The
ratio column ``vs vLLM`` is taken against the better of the two. ``--single-stream`` replaces the
workload with one 248-token prompt and 128 new tokens (transformers at batch 1). The verdict
under the table judges the engine against that run by the page's target (``floors.py``): one
stream 1.5x vLLM and 60 % of the floor; a batch 1.5x vLLM or 80 % of the floor, the lower.

Every CPU run also measures this machine's floors, before its timed runs and again after them,
each rate the faster of the two probes (``floors.py``: the memory read rate over the weights'
size, the matmul rate at the model's shapes), and gives each row as a fraction
of the workload's floor, the most tok/s the machine allows it: that fraction, unlike a tok/s
figure, compares across VMs and days.

``--quiet-below LOAD`` waits, before every timed run, until the 1-minute load average is below
LOAD (others' jobs share the cores); after ``--quiet-timeout-min`` minutes of waiting in all it
stops waiting and measures anyway, and the table marks those rows.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from floors import SINGLE_STREAM_TARGET, THROUGHPUT_TARGET, Floors, judge, measure_floors
from machine import add_quiet_arg, check_quiet, cpu_flags, cpu_name, load_average, machine_line

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VLLM_VENV = REPO / ".venv-vllm"
# nano-vllm's source (never copied into the book): beside the repository here, inside the
# device machine's copy of the working tree.
NANO_VLLM_DIRS = (REPO.parent / "shared" / "peers" / "nano-vllm", REPO / "shared" / "peers" / "nano-vllm")


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    outputs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outputs


def bench_engine(
    model_dir: str,
    prompts,
    outputs,
    temperature: float,
    watch: LoadWatch | None = None,
    more_workloads: list | None = None,
    **engine_kwargs,
) -> tuple[list[float], float]:
    """The engine's output tok/s on the workload after a 4-token request, then on each of
    ``more_workloads`` ((prompts, outputs) pairs) in the same engine; and its start-up seconds
    (model load and, unless ``warm_up=False``, the start-up warm-up)."""
    from vllm_from_scratch import LLM, SamplingParams

    watch = watch or LoadWatch()
    start = time.perf_counter()
    llm = LLM(model_dir, **engine_kwargs)
    startup_s = time.perf_counter() - start
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # as vllm_peer_runner does
    rates = []
    for batch_prompts, batch_outputs in [(prompts, outputs), *(more_workloads or [])]:
        # Unseeded, as nano-vllm's bench.py: a seeded row costs one noise draw of its own per step.
        params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in batch_outputs]
        watch.before()
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        watch.after()
        assert [len(o["token_ids"]) for o in outs] == list(batch_outputs)
        rates.append(sum(batch_outputs) / elapsed)
    llm.shutdown()
    return rates, startup_s


def bench_transformers(
    model_dir: str,
    prompts,
    outputs,
    dtype: str,
    batch_size: int,
    watch: LoadWatch | None = None,
    device: str = "cpu",
) -> float:
    """transformers' ``generate`` in static left-padded batches; output tok/s counts requested tokens."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(batch_prompts, max_new):
        width = max(map(len, batch_prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )

    run([prompts[0][:16]], 4)  # warm-up
    watch = watch or LoadWatch()
    watch.before()
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"transformers {dtype}"):
        run(prompts[i : i + batch_size], max(outputs[i : i + batch_size]))
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    watch.after()
    return sum(outputs) / elapsed


# Qwen3-0.6B's shape (its config.json), the checkpoint nano-vllm's bench.py runs.
QWEN3_06B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
)


def make_small_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer of a few hundred tokens, trained here on one sentence and saved
    at ``path``: nano-vllm (and the engine's detokenizer) load a tokenizer even for token-id
    prompts, and ids past its vocabulary decode to nothing. Built, not copied, so a bare GPU
    machine without the default model (``.models/`` never travels) can make it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["the paged KV cache holds blocks of tokens that attention reads through block tables"], trainer
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)


def make_qwen3_06b_shaped(path: str, **overrides: int) -> str:
    """A random-weight bfloat16 checkpoint shaped like Qwen3-0.6B (``overrides`` shrink it for a
    CPU dry run) with :func:`make_small_tokenizer`'s tokenizer, built with transformers at ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **{**QWEN3_06B_SHAPE, **overrides}, tie_word_embeddings=True, rms_norm_eps=1e-6, dtype="bfloat16"
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    make_small_tokenizer(path)
    return path


def machine_info(load_before: str) -> dict:
    """The machine as the JSON reports give it, with the load average before and now."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


def wait_for_quiet(threshold: float, deadline: float, poll_s: float = 15.0) -> bool:
    """Sleep until the 1-minute load average is below ``threshold`` or ``time.time()`` passes
    ``deadline``; True if the machine got quiet. Other people's jobs share these cores, and a busy
    neighbour slows every side of a comparison, not always equally."""
    from tqdm.auto import tqdm

    if os.getloadavg()[0] < threshold:
        return True
    with tqdm(desc=f"waiting for load < {threshold}", unit="s", total=None) as bar:
        while os.getloadavg()[0] >= threshold:
            if time.time() >= deadline:
                print(f"gave up waiting for a quiet machine (load {load_average()}); measuring anyway")
                return False
            bar.set_postfix(load=f"{os.getloadavg()[0]:.2f}")
            time.sleep(poll_s)
            bar.update(poll_s)
    return True


@dataclass
class LoadWatch:
    """Waits for a quiet machine before each timed run (if ``quiet_below`` is set) and records the
    load average around it: one record per run in ``records``.

    ``deadline`` (a ``time.time()``) is shared by every wait of a script run, so that the
    45-minute give-up bounds the whole run, not each row.
    """

    quiet_below: float | None = None
    deadline: float | None = None
    records: list[dict] = field(default_factory=list)

    def before(self) -> None:
        start, quiet = time.time(), None
        if self.quiet_below is not None:
            quiet = wait_for_quiet(self.quiet_below, self.deadline or float("inf"))
        self.records.append({"load_before": load_average(), "waited_s": round(time.time() - start, 1), "quiet": quiet})

    def after(self) -> None:
        self.records[-1]["load_after"] = load_average()


def vllm_python(venv: Path) -> Path:
    """The interpreter of vLLM's virtualenv, or exit saying which script builds it."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"--peer vllm needs vLLM's CPU build in {venv}, which does not exist: build it with "
            f"07_engine/benchmarks/make_vllm_venv.sh (a few minutes; never part of ./setup.sh)"
        )
    return python


def usable_cores() -> str:
    """The cores this process may run on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` spells a list."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    contiguous = cores == list(range(cores[0], cores[-1] + 1))
    return f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))


def vllm_bindings() -> dict[str, dict[str, str]]:
    """vLLM's two thread layouts on a CPU: its defaults (one core computes, one is reserved for
    the front end and engine core loop), and every usable core bound for compute."""
    return {
        "defaults": {},
        "all-cores-bound": {"VLLM_CPU_OMP_THREADS_BIND": usable_cores(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    }


def bench_vllm(
    python: Path,
    model_dir: str,
    prompts,
    outputs,
    dtype: str,
    binding: dict[str, str],
    kv_cache_gib: int,
    watch: LoadWatch,
) -> tuple[float, dict]:
    """vLLM's output tok/s on the workload, in its own virtualenv; also its runner's report
    (start-up time, what each of its processes did with the cores)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    env.update(binding, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), TOKENIZERS_PARALLELISM="false")
    # vLLM warns once per weight that it casts the float32 checkpoint to bfloat16: hundreds of lines.
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(
            json.dumps(
                {
                    "model": model_dir,
                    "dtype": dtype,
                    "prompts": prompts,
                    "outputs": outputs,
                    "quiet_below": watch.quiet_below,
                    "quiet_deadline": watch.deadline,
                }
            )
        )
        done = subprocess.run([str(python), str(HERE / "vllm_peer_runner.py"), str(spec), str(result)], env=env)
        if done.returncode != 0:
            raise RuntimeError(f"vllm_peer_runner.py exited with {done.returncode} (its output is above)")
        report = json.loads(result.read_text())
    watch.records.append(report["load"])
    return report["output_tokens_per_s"], report


def print_table(
    rows: list[tuple[str, float]],
    baseline: float | None,
    peer: float | None = None,
    loads: list[dict] | None = None,
    peer_name: str = "vLLM",
    floor: float | None = None,
) -> None:
    """One line per system: tok/s, ratio to the best transformers run (and the best run of the
    peer, vLLM or nano-vllm), its fraction of the workload's floor (``floor``: the most tok/s the
    machine allows, floors.py), and the load average before → after its timed run (* where
    waiting for quiet gave up)."""
    peer_head = f"{'vs ' + peer_name:>14}" if peer else ""
    floor_head = f"{'of floor':>10}" if floor else ""
    load_head = f"  {'load before -> after':<24}" if loads else ""
    width = max([46, *(len(name) + 2 for name, _ in rows)])
    print(f"\n{'system':<{width}}{'output tok/s':>14}{'vs transformers':>18}{peer_head}{floor_head}{load_head}")
    print("-" * (width + 32 + len(peer_head) + len(floor_head) + len(load_head)))
    for i, (name, tps) in enumerate(rows):
        ratio = f"{tps / baseline:.2f}x" if baseline else "-"
        line = f"{name:<{width}}{tps:>14.1f}{ratio:>18}"
        if peer:
            line += f"{tps / peer:>13.2f}x"
        if floor:
            line += f"{tps / floor:>10.0%}"
        if loads:
            rec = loads[i]
            gave_up = "*" if rec.get("quiet") is False else ""
            line += f"  {rec['load_before'].split()[0]} -> {rec['load_after'].split()[0]}{gave_up}"
        print(line)
    if loads and any(rec.get("quiet") is False for rec in loads):
        print("* the machine never got quiet before the wait ran out; measured anyway")


def write_json(
    path: str,
    workload: dict,
    rows: list[tuple[str, float]],
    baseline: float | None,
    load_before: str,
    peer: float | None = None,
    loads: list[dict] | None = None,
    details: dict[str, dict] | None = None,
    peer_name: str = "vLLM",
    floors: dict | None = None,
    verdict: dict | None = None,
) -> None:
    """The table as JSON; ``floors`` (the machine's measured floors and the workload's floor tok/s)
    adds each row's ``fraction_of_floor``, ``verdict`` the engine's against its target."""
    report = {
        "machine": machine_info(load_before),
        "workload": workload,
        "floors": floors,
        "rows": [],
    }
    for i, (name, tps) in enumerate(rows):
        row = {
            "system": name,
            "output_tokens_per_s": round(tps, 2),
            "vs_transformers": round(tps / baseline, 3) if baseline else None,
        }
        if peer:
            row["vs_" + peer_name.lower().replace("-", "_")] = round(tps / peer, 3)
        if floors:
            row["fraction_of_floor"] = round(tps / floors["workload_floor_tokens_per_s"], 3)
        if loads:
            row["load"] = loads[i]
        if details and name in details:
            row["details"] = details[name]
        report["rows"].append(row)
    if verdict:
        report["verdict"] = verdict
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def add_peer_args(parser: argparse.ArgumentParser, bindings_help: str) -> None:
    """The flags bench.py and bench_serving.py share: where vLLM is and how it runs, and how
    long to wait for a quiet machine."""
    parser.add_argument(
        "--vllm-bindings", nargs="+", default=list(vllm_bindings()), choices=list(vllm_bindings()), help=bindings_help
    )
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=VLLM_VENV,
        help="vLLM's virtualenv (default: .venv-vllm, built by 07_engine/benchmarks/make_vllm_venv.sh)",
    )
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE for vLLM")
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=None,
        metavar="LOAD",
        help="before each timed run, wait until the 1-minute load average is below LOAD",
    )
    parser.add_argument(
        "--quiet-timeout-min",
        type=float,
        default=45.0,
        help="total minutes to wait for quiet in one run before measuring anyway",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="nano-vllm's workload on a Qwen3-0.6B-shaped model (CUDA)")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="default 128 (CPU); 256 with --gpu (nano-vllm's)"
    )
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--single-stream",
        action="store_true",
        help="one 248-token prompt, 128 new tokens (transformers at batch 1); overrides the "
        "workload and --hf-batch-sizes",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="engine dtype (and vLLM's, with --peer); auto: the engine's rule, bfloat16 where the CPU has it natively",
    )
    parser.add_argument(
        "--hf-dtypes",
        nargs="*",
        default=["float32", "bfloat16"],
        help="transformers dtypes; the ratio is taken against the faster (which one depends on the CPU)",
    )
    parser.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="*",
        default=[32, 64],
        help="transformers static batch sizes, each run over the whole workload (none: skip transformers)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the engine's forward eagerly (EngineConfig.enforce_eager): "
        "no compiled graphs, no compile at the first start",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for both sides (default: torch's own choice, the usable cores)",
    )
    parser.add_argument(
        "--peer",
        choices=["vllm"],
        default=None,
        help="also run vLLM's CPU build (its defaults, then all cores bound) on the workload",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="engine passes over the workload in one engine, each with new prompts (another "
        "seed): pass 1 is what a user meets first, later passes show what is left to warm",
    )
    parser.add_argument(
        "--engine-warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's start-up warm-up (EngineConfig.warm_up)",
    )
    add_peer_args(parser, "vLLM thread layouts to run with --peer vllm (default: both)")
    parser.add_argument(
        "--nano-vllm",
        type=Path,
        default=next((d for d in NANO_VLLM_DIRS if (d / "nanovllm").is_dir()), None),
        metavar="DIR",
        help="with --gpu: nano-vllm's source, run beside the engine (default: shared/peers/nano-vllm "
        "beside or inside the repository, where it exists)",
    )
    parser.add_argument(
        "--gpu-modes",
        nargs="*",
        choices=("eager", "graphs"),
        default=["eager", "graphs"],
        help="with --gpu: the engine eager and/or with CUDA graphs (default: both; none: the peers alone)",
    )
    parser.add_argument(
        "--gpu-peers",
        nargs="*",
        choices=("nano-vllm",),
        default=["nano-vllm"],
        help="with --gpu: the peers beside the engine in each mode (none: the engine alone)",
    )
    parser.add_argument(
        "--hf-max-requests",
        type=int,
        default=None,
        help="with --gpu: transformers runs the first N requests only (a static batch costs what its "
        "longest output does, so one batch of N stands for every batch of N); default: all",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="with --gpu: the same code on the CPU, a tiny workload, in seconds"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    add_quiet_arg(parser)
    args = parser.parse_args(argv)
    check_quiet(args.refuse_busy)
    if args.hf_batch_sizes and min(args.hf_batch_sizes) < 1:
        parser.error("--hf-batch-sizes must be >= 1")
    if args.num_requests is not None and args.num_requests < 1:
        parser.error("--num-requests must be >= 1")
    if args.hf_max_requests is not None and args.hf_max_requests < 1:
        parser.error("--hf-max-requests must be >= 1")
    if args.passes < 1:
        parser.error("--passes must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.single_stream:
        args.num_requests, args.input_len, args.output_len, args.hf_batch_sizes = 1, (248, 248), (128, 128), [1]
    return args


def bench_nanovllm(
    nano_vllm_dir: Path, model_dir: str, prompts, outputs, temperature: float, enforce_eager: bool
) -> dict:
    """nano-vllm's output tok/s on the workload, run by ``nanovllm_peer_runner.py`` from its source
    directory in a process of its own; returns the runner's report."""
    with tempfile.TemporaryDirectory(prefix="nanovllm-peer-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        workload = {"model": model_dir, "prompts": prompts, "outputs": outputs, "temperature": temperature}
        settings = {"enforce_eager": enforce_eager, "max_model_len": 4096}
        spec.write_text(json.dumps({"nano_vllm_dir": str(nano_vllm_dir), **workload, **settings}))
        runner = HERE / "nanovllm_peer_runner.py"
        done = subprocess.run([sys.executable, str(runner), str(spec), str(result)])
        if done.returncode != 0:
            raise RuntimeError(f"nanovllm_peer_runner.py exited with {done.returncode} (its output is above)")
        return json.loads(result.read_text())


# The --gpu --dry-run workload: run_gpu's own code on a CPU with a tiny checkpoint, in seconds.
DRY_RUN_WORKLOAD = dict(in_range=(4, 8), out_range=(2, 4), vocab=100)


def run_gpu(args: argparse.Namespace, load_before: str) -> None:
    """nano-vllm's workload on a random Qwen3-0.6B-shaped checkpoint, in each of ``--gpu-modes``
    (eager, CUDA graphs), on the engine, on nano-vllm itself (where its source and flash-attn are
    found) and on transformers' ``generate`` (greedy, static batches of ``--hf-batch-sizes``, over
    the first ``--hf-max-requests`` requests). A peer that cannot run or fails is reported and
    skipped; the engine's rows are always measured. ``--dry-run``: the same code on the CPU, a
    tiny workload, float32, the engine eager in every mode (a CPU has no CUDA graphs; the rows
    say so)."""
    dry = args.dry_run
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    num_requests = args.num_requests or (4 if dry else 256)
    if dry:
        prompts, outputs = make_workload(num_requests, seed=args.seed, **DRY_RUN_WORKLOAD)
    else:
        prompts, outputs = make_workload(num_requests, (100, 1024), (100, 1024), 10000, args.seed)
    model_dir = args.model or make_qwen3_06b_shaped(tempfile.mkdtemp(prefix="qwen3-0.6b-random-"))
    nano_vllm = None
    if "nano-vllm" not in args.gpu_peers:
        pass
    elif args.nano_vllm is None:
        print(f"nano-vllm not run: no source at {', '.join(map(str, NANO_VLLM_DIRS))} (pass --nano-vllm DIR)")
    elif dry or importlib.util.find_spec("flash_attn") is None:
        print("nano-vllm not run: it needs CUDA and flash-attn, and flash-attn is not installed here")
    else:
        nano_vllm = args.nano_vllm
    rows, peer = [], []
    for mode in args.gpu_modes:
        eager = mode == "eager"
        label = {"eager": "eager", "graphs": "CUDA graphs"}[mode] + (", dry run: eager on the CPU" if dry else "")
        # nano-vllm first: its process exits and returns all its memory before the engine sizes its
        # KV cache, and the engine's is released (below) before the next nano-vllm run sizes its own.
        if nano_vllm is not None:
            try:
                report = bench_nanovllm(nano_vllm, model_dir, prompts, outputs, 0.6, eager)
                peer.append((f"nano-vllm bf16 ({label})", report["output_tokens_per_s"]))
            except (RuntimeError, OSError, KeyError, json.JSONDecodeError) as exc:
                print(f"nano-vllm ({label}) failed, skipped: {exc}")
        (tps,), _ = bench_engine(
            model_dir,
            prompts,
            outputs,
            0.6,
            device=device,
            max_model_len=4096,
            enforce_eager=eager or dry,
            dtype=dtype,
        )
        rows.append((f"engine {dtype} ({label})", tps))
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    hf = []
    hf_count = min(args.hf_max_requests or num_requests, num_requests)
    for b in args.hf_batch_sizes:
        subset = "" if hf_count == num_requests else f", first {hf_count} requests"
        try:
            tps = bench_transformers(model_dir, prompts[:hf_count], outputs[:hf_count], dtype, b, device=device)
            hf.append((f"transformers {dtype} greedy (batch {b}{subset})", tps))
        except torch.OutOfMemoryError as exc:
            print(f"transformers at batch {b} ran out of memory, skipped: {exc}")
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    card = torch.cuda.get_device_name() if device == "cuda" else f"CPU dry run ({cpu_name()})"
    shape = "tiny random checkpoint" if dry else "Qwen3-0.6B-shaped random weights"
    lens = "{}-{}".format(*DRY_RUN_WORKLOAD["in_range"]) if dry else "100-1024"
    print(
        f"\n{card}, {shape}, {num_requests} seqs, in {lens}; "
        f"host {machine_line()}; load average before {load_before}, after {load_average()}"
    )
    best_hf = max((t for _, t in hf), default=None)
    best_peer = max((t for _, t in peer), default=None)
    print_table(rows + peer + hf, best_hf, best_peer, peer_name="nano-vllm")
    for name, tps in rows:
        print(f"result: {name} {tps:.1f} tok/s" + (f", {tps / best_hf:.2f}x transformers" if best_hf else ""))
    for name, tps in hf:
        print(f"result: {name} {tps:.1f} tok/s")
    if args.json:
        workload = {
            "model": shape,
            "device": card,
            "num_requests": num_requests,
            "input_len": [100, 1024],
            "output_len": [100, 1024],
            "temperature": 0.6,
            "transformers_requests": hf_count,
        }
        if dry:
            workload.update(input_len=list(DRY_RUN_WORKLOAD["in_range"]))
            workload.update(output_len=list(DRY_RUN_WORKLOAD["out_range"]))
        write_json(args.json, workload, rows + peer + hf, best_hf, load_before, best_peer, peer_name="nano-vllm")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = load_average()
    if args.gpu:
        if not (torch.cuda.is_available() or args.dry_run):
            raise SystemExit("--gpu needs CUDA (or --dry-run, which runs its code on the CPU)")
        return run_gpu(args, load_before)
    if args.dry_run:
        raise SystemExit("--dry-run goes with --gpu")
    args.num_requests = args.num_requests or 128
    python = vllm_python(args.vllm_venv) if args.peer == "vllm" else None  # fail before any work

    from vllm_from_scratch import default_model_dir
    from vllm_from_scratch.loader import resolve_dtype

    model_dir = args.model or default_model_dir()
    dtype = resolve_dtype(args.dtype, "cpu")
    args.dtype = str(dtype).removeprefix("torch.")  # labels and vLLM need a name
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts, outputs = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    watch = LoadWatch(args.quiet_below, time.time() + 60 * args.quiet_timeout_min)
    floors = measure_floors(model_dir, dtype)
    engine_kwargs = dict(dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs)
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine_kwargs["warm_up"] = args.engine_warm_up
    engine_kwargs["enforce_eager"] = args.enforce_eager
    # Later passes draw new prompts (another seed), so the prefix cache cannot serve them.
    more = [
        make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab, args.seed + i)
        for i in range(1, args.passes)
    ]
    rates, startup_s = bench_engine(model_dir, prompts, outputs, 0.0, watch=watch, more_workloads=more, **engine_kwargs)
    engine_name = f"engine {args.dtype}{' eager' * args.enforce_eager}"
    engine_name += "" if args.engine_warm_up else " (no start-up warm-up)"
    rows = [(engine_name + (f", pass {i + 1}" if args.passes > 1 else ""), tps) for i, tps in enumerate(rates)]
    details = {rows[0][0]: {"startup_s": round(startup_s, 2)}}
    hf = [
        (f"transformers {d} (batch {b}, left pad)", bench_transformers(model_dir, prompts, outputs, d, b, watch))
        for d in args.hf_dtypes
        for b in args.hf_batch_sizes
    ]
    peer = []
    for label in args.vllm_bindings if python else ():
        binding = vllm_bindings()[label]
        name = f"vLLM {vllm_version(python)} CPU {args.dtype} ({label})"
        tps, details[name] = bench_vllm(
            python, model_dir, prompts, outputs, args.dtype, binding, args.vllm_kv_cache_gib, watch
        )
        peer.append((name, tps))
    floors = floors.faster(measure_floors(model_dir, dtype))
    floor_tps = workload_floor(floors, prompts, outputs)
    best_hf = max((t for _, t in hf), default=None)
    best_peer = max((t for _, t in peer), default=None)
    print(
        f"\n{args.num_requests} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, "
        f"{args.output_len[0]}-{args.output_len[1]} new tokens, greedy, ignore_eos\n{machine_line()}\n"
        f"load average (1/5/15 min) before {load_before}, after {load_average()}"
    )
    print(f"{floors.describe()}\n{floor_summary(floors, prompts, outputs)}")
    print_table(rows + hf + peer, best_hf, best_peer, watch.records, floor=floor_tps)
    check = engine_verdict(rows, peer, floor_tps, args.single_stream)
    if check:
        print(
            f"\nthe engine{' (median pass)' * (len(rows) > 1)} / {check['against']}: {check['ratio']:.2f}x; "
            f"target ({check['target']}): {check['target_tokens_per_s']:.1f} tok/s, "
            f"{'met' if check['target_met'] else 'not met'}"
        )
    print(f"\nthe engine started in {startup_s:.1f} s (model load{' and warm-up' if args.engine_warm_up else ''})")
    for name, _ in peer:
        print_vllm_processes(name, details[name])
    if args.json:
        workload = {
            "model": model_dir,
            "num_requests": args.num_requests,
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
            "temperature": 0.0,
            "engine_dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs,
            "hf_batch_sizes": args.hf_batch_sizes,
            "single_stream": args.single_stream,
            "engine_warm_up": args.engine_warm_up,
            "passes": args.passes,
            "quiet_below": args.quiet_below,
        }
        floors_json = {**floors.as_json(), "workload_floor_tokens_per_s": round(floor_tps, 1)}
        write_json(
            args.json,
            workload,
            rows + hf + peer,
            best_hf,
            load_before,
            best_peer,
            watch.records,
            details,
            floors=floors_json,
            verdict=check,
        )


def engine_verdict(
    engine_rows: list[tuple[str, float]], peer: list[tuple[str, float]], floor_tps: float, single_stream: bool
) -> dict:
    """The engine's median pass against the faster vLLM run, by the page's target for the workload
    (one stream: ``SINGLE_STREAM_TARGET``; a batch: ``THROUGHPUT_TARGET``); ``{}`` without a peer."""
    if not peer:
        return {}
    against, peer_tps = max(peer, key=lambda row: row[1])
    target = SINGLE_STREAM_TARGET if single_stream else THROUGHPUT_TARGET
    return {"against": against, **judge(statistics.median(t for _, t in engine_rows), peer_tps, floor_tps, target)}


def workload_floor(floors: Floors, prompts: list[list[int]], outputs: list[int]) -> float:
    """The most output tok/s the measured floors allow the workload ``prompts`` / ``outputs``."""
    return floors.tokens_per_s(sum(map(len, prompts)), sum(outputs), len(prompts), max(outputs))


def floor_summary(floors: Floors, prompts: list[list[int]], outputs: list[int]) -> str:
    """Which floor binds the workload, in words: one line under the floors' rates."""
    seconds = floors.seconds(sum(map(len, prompts)), sum(outputs), len(prompts), max(outputs))
    binding = max(seconds, key=seconds.get)
    return (
        f"this workload's floor: {workload_floor(floors, prompts, outputs):.1f} output tok/s "
        f"(memory {seconds['memory']:.2f} s, matmul {seconds['matmul']:.2f} s: the {binding} bound)"
    )


def vllm_version(python: Path) -> str:
    """The installed vllm-cpu version, read from its metadata without importing vLLM."""
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def print_vllm_processes(name: str, report: dict) -> None:
    """Where vLLM's threads ran during the timed run: its front end, engine core and worker."""
    print(f"\n{name}: start-up {report['startup_s']:.1f} s; during the timed run:")
    for p in report["processes"]:
        threads = ", ".join(f"bound to {t['cores']} {t['busy']:.0%} busy" for t in p["busy_threads"])
        print(
            f"  {p['name']:<18} {p['threads']:>3} threads, {p['cores_busy']:.2f} cores busy"
            f"{': ' + threads if threads else ''}"
        )


if __name__ == "__main__":
    main()
