"""Time and profile the engine's model forward on its own: decode steps and a prefill chunk.

Builds a :class:`~vllm_from_scratch.model_runner.ModelRunner` (weights loaded and prepacked, KV
cache bound) and calls ``model(input_ids, positions, attn_metadata)`` plus ``compute_logits`` on
synthetic batches, without the scheduler or the sampler:

* ``decode B``: ``B`` requests, one new token each, every one with ``--context-len`` tokens;
* ``prefill P``: one request's first ``P`` tokens.

For each shape it prints the first call (oneDNN creates a primitive the first time it meets a
matmul shape) and the median of ``--iters`` later calls, with the load average beside them.
``--profile`` adds a ``torch.profiler`` breakdown by op group, and the time spent outside any
op (Python and per-op dispatch). ``--compile`` builds the runner with its compiled forward (``enforce_eager=False``)
and times every shape twice in a row, eager and through the compiled graphs
(``vllm_from_scratch/compilation.py``).

    .venv/bin/python 07_engine/benchmarks/profile_model.py --profile                # decode 1 and 32, prefill 512
    .venv/bin/python 07_engine/benchmarks/profile_model.py --repeats 3 --bf16-only   # without the float32 copies
    .venv/bin/python 07_engine/benchmarks/profile_model.py --compile --repeats 7      # eager against compiled
    .venv/bin/python 07_engine/benchmarks/profile_model.py --engine-steps             # the whole step, by phase

``--engine-steps`` times whole ``LLMEngine.step()`` calls instead, on real requests (decode
steps of ``B`` requests with ``--context-len``-token prompts, then a prefill chunk of each
length), split by phase: scheduling, building the inputs (chapter 06), the forward, the LM head,
sampling, the scheduler's update, and detokenizing with stop checks; "other" is the rest of the
step. Everything but the forward and the LM head is the engine's own Python.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from attention_backends import AttentionMetadata
from block_manager import cdiv
from vllm_from_scratch import default_model_dir
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.layers.prepacked import FLOAT32_MIN_ROWS, PrepackableWeight, prepack_model
from vllm_from_scratch.model_runner import ModelRunner

# Profiler op names (substrings) → group. First match wins; anything else is "other ops".
OP_GROUPS = [
    ("linear (matmul)", ("_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul")),
    ("attention", ("paged_attention", "scaled_dot_product", "_flash_attention", "index_select")),
    ("kv write", ("store_kvcache", "index_copy")),
    ("dtype casts", ("aten::to", "aten::_to_copy")),  # mostly the float32 matmul path's up/down casts
    (
        "elementwise",
        (
            "aten::mul",
            "aten::add",
            "aten::sub",
            "aten::silu",
            "aten::rsqrt",
            "vector_norm",
            "rms_norm",
            "aten::roll",
            "aten::cat",
            "aten::copy_",
            "aten::square",
            "aten::div",
            "aten::neg",
            "aten::embedding",
            "aten::index",
            "aten::clone",
            "aten::contiguous",
        ),
    ),
]


def machine() -> str:
    """CPU model, core count and the bf16-related flags that decide which matmul paths exist."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    wanted = [f for f in ("avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(wanted) or 'no bf16 flags'}"


def op_group(name: str) -> str:
    for group, keys in OP_GROUPS:
        if any(k in name for k in keys):
            return group
    return "other ops"


class Batches:
    """Synthetic batches for one runner: every request owns consecutive KV blocks."""

    def __init__(self, runner: ModelRunner, context_len: int):
        self.runner, self.context_len = runner, context_len
        self.block_size = runner.block_size
        self.vocab = runner.model.config.vocab_size

    def _batch(self, q_lens: list[int], k_lens: list[int]):
        bs = self.block_size
        width = cdiv(max(k_lens), bs)
        if width * len(q_lens) > self.runner.num_kvcache_blocks:
            raise SystemExit(
                f"the KV cache holds {self.runner.num_kvcache_blocks} blocks, the batch needs "
                f"{width * len(q_lens)}: lower --context-len or the batch size"
            )
        block_tables = torch.arange(width * len(q_lens), dtype=torch.int32).view(len(q_lens), width)
        positions = torch.cat([torch.arange(k - q, k) for q, k in zip(q_lens, k_lens)])
        seq_ids = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
        slots = block_tables[seq_ids, positions // bs].long() * bs + positions % bs
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        md = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=cu,
            seq_lens_k=torch.tensor(k_lens, dtype=torch.int32),
            block_tables=block_tables,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
        )
        input_ids = torch.randint(0, self.vocab, (len(positions),), generator=torch.Generator().manual_seed(0))
        logits_indices = cu[1:].long() - 1
        return input_ids, positions, md, logits_indices

    def decode(self, batch_size: int):
        return self._batch([1] * batch_size, [self.context_len] * batch_size)

    def prefill(self, num_tokens: int):
        return self._batch([num_tokens], [num_tokens])


@torch.inference_mode()
def step(runner: ModelRunner, batch, compiled: bool = False) -> torch.Tensor:
    """Logits of ``batch``'s last rows, the forward eager or (``compiled``) through the runner's
    compiled graphs."""
    input_ids, positions, md, logits_indices = batch
    if compiled:
        hidden = runner.compiled_forward.run(input_ids, positions, md, runner.kv_cache)
    else:
        hidden = runner.model(input_ids, positions, md)
    return runner.model.compute_logits(hidden[logits_indices])


def time_step(runner: ModelRunner, batch, iters: int, compiled: bool = False) -> tuple[float, float, float]:
    """(first call, median of ``iters`` later calls, median CPU time of this process), in ms.

    With ``--threads 1`` the CPU time is the work itself, whatever else shares the cores: on a
    loaded machine it is the steadier figure to compare two variants by.
    """
    start = time.perf_counter()
    step(runner, batch, compiled)
    first = (time.perf_counter() - start) * 1e3
    times, cpu_times = [], []
    for _ in range(iters):
        start, cpu_start = time.perf_counter(), time.process_time()
        step(runner, batch, compiled)
        times.append((time.perf_counter() - start) * 1e3)
        cpu_times.append((time.process_time() - cpu_start) * 1e3)
    return first, statistics.median(times), statistics.median(cpu_times)


def label_attention_calls() -> None:
    """Give chapter 01's and 02's calls a profiler label: the C++ decode kernel is not a torch op,
    so without one its time would count as "outside any op"."""
    from vllm_from_scratch.layers import attention

    def labelled(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return call

    attention.paged_attention = labelled("paged_attention", attention.paged_attention)
    attention.store_kvcache = labelled("store_kvcache", attention.store_kvcache)


def profile_step(runner: ModelRunner, batch, iters: int, compiled: bool = False) -> None:
    """Per-op-group time of ``iters`` calls, and the wall time no top-level op accounts for."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            step(runner, batch, compiled)
        wall = (time.perf_counter() - start) * 1e3 / iters
    groups, ops = defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.cpu_parent is None:  # top-level ops only: their time includes their children's
            groups[op_group(e.name)] += e.cpu_time_total / 1e3 / iters
            ops[e.name] += e.cpu_time_total / 1e3 / iters
    in_ops = sum(groups.values())
    print(f"    profiled wall {wall:.2f} ms/step (profiler overhead included)")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"      {group:<22} {ms:8.2f} ms  {100 * ms / wall:5.1f} %")
    print(f"      {'outside any op':<22} {wall - in_ops:8.2f} ms  {100 * (wall - in_ops) / wall:5.1f} %")
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    print("    top-level ops: " + ", ".join(f"{name} {ms:.2f}" for name, ms in top))


ENGINE_PHASES = (
    ("scheduler", "schedule", "schedule"),
    ("model_runner", "build_batch_inputs", "build inputs"),
    ("runner", "_forward", "forward"),
    ("runner", "_logits", "LM head"),
    ("sampler", "sample", "sample"),
    ("scheduler", "update_from_output", "update"),
    ("output_processor", "process_outputs", "detokenize"),
)


def time_engine_phases(args: argparse.Namespace) -> None:
    """Median phase times of real engine steps (``--engine-steps``): see the module docstring."""
    import vllm_from_scratch.model_runner as model_runner
    from vllm_from_scratch import LLM, SamplingParams

    # Every decoding request's prompt in one step, so that all of them decode from --context-len:
    # under a smaller budget the first ones would decode while later ones still filled their
    # prompts chunk by chunk, and attend to far longer contexts in the timed steps.
    budget = max(args.prefill_lens + [max(args.batch_sizes) * args.context_len])
    engine = LLM(
        args.model or default_model_dir(),
        dtype=args.dtype,
        max_num_batched_tokens=budget,
        enforce_eager=not args.compile,
    ).llm_engine
    spent: dict[str, float] = defaultdict(float)
    runner = engine.executor.runner
    owners = {"scheduler": engine.scheduler, "model_runner": model_runner, "runner": runner}
    owners.update(sampler=runner.sampler, output_processor=engine.output_processor)
    for owner, attr, label in ENGINE_PHASES:
        fn = getattr(owners[owner], attr)

        def timed(*a, _fn=fn, _label=label, **kw):
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_label] += time.perf_counter() - start

        setattr(owners[owner], attr, timed)
    print(machine())
    print(f"engine steps; {engine.config.torch_dtype}, {torch.get_num_threads()} threads")
    # Room to decode to the context limit: a request that finished while later ones still filled
    # their prompts (chunk by chunk under a small token budget) would leave the timed steps short.
    max_tokens = engine.config.max_model_len - args.context_len
    if max_tokens <= args.iters:
        raise ValueError(f"--context-len {args.context_len} leaves no room for {args.iters} decode steps")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        return [(31 * next(ids)) % (engine.config.vocab_size - 200) + 100 for _ in range(n)]

    def report(name: str, steps: int, wall: float) -> None:
        parts = {label: spent[label] * 1e3 / steps for _, _, label in ENGINE_PHASES}
        other = wall * 1e3 / steps - sum(parts.values())
        cells = "  ".join(f"{k} {v:.2f}" for k, v in parts.items())
        print(
            f"  {name:<13} step {wall * 1e3 / steps:8.2f} ms  {cells}  other {other:.2f}  load {os.getloadavg()[0]:.2f}"
        )

    for _ in range(args.repeats):
        for b in args.batch_sizes:
            for _ in range(b):
                engine.add_request(prompt(args.context_len), params)
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
                engine.step()
            spent.clear()
            start = time.perf_counter()
            for _ in range(args.iters):
                decoded = len(engine.step())
                if decoded != b:
                    raise RuntimeError(f"a decode step of B={b} gave {decoded} requests' tokens")
            report(f"decode B={b}", args.iters, time.perf_counter() - start)
            for rid in list(engine.scheduler.requests):
                engine.abort_request(rid)
            engine.step()
        for n in args.prefill_lens:
            engine.add_request(prompt(n + 1), SamplingParams(max_tokens=1))
            spent.clear()
            start = time.perf_counter()
            engine.step()  # the first n tokens: a chunk that does not sample
            report(f"prefill {n}", 1, time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="*", default=[1, 32], help="decode batch sizes (default: 1 32)"
    )
    parser.add_argument(
        "--context-len", type=int, default=256, help="tokens each decoding request attends to (default: 256)"
    )
    parser.add_argument(
        "--prefill-lens", type=int, nargs="*", default=[512], help="prefill chunk lengths (default: 512)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per shape after the first (default: 20)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="time every shape this many times, interleaved (default: 1)"
    )
    parser.add_argument("--profile", action="store_true", help="also break each shape down with torch.profiler")
    parser.add_argument(
        "--bf16-only",
        action="store_true",
        help="drop the float32 weight copies (layers/prepacked.py): every matmul in bf16",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the forward compiled by inductor (the engine's default on a CPU), alternating with the eager "
        "one; with --engine-steps, the engine runs compiled (else eager)",
    )
    parser.add_argument(
        "--engine-steps",
        action="store_true",
        help="time whole engine steps on real requests, split by phase, instead of the forward alone",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine_steps:
        time_engine_phases(args)
        return

    start = time.perf_counter()
    runner = ModelRunner(
        EngineConfig(
            args.model or default_model_dir(),
            device="cpu",
            dtype=args.dtype,
            max_num_seqs=max(args.batch_sizes + [1]),
            enforce_eager=not args.compile,
        )
    )
    if args.bf16_only:
        prepack_model(runner.model, float32_copies=False)
    packable = [m for m in runner.model.modules() if isinstance(m, PrepackableWeight)]
    fp32_copies = sum(m.packed_weight_fp32 is not None for m in packable)
    print(machine())
    print(
        f"runner built in {time.perf_counter() - start:.1f} s; {args.dtype}, {torch.get_num_threads()} threads; "
        f"float32 copies for matmuls of {FLOAT32_MIN_ROWS}+ rows: {fp32_copies} of {len(packable)} weights"
    )
    if args.profile:
        label_attention_calls()
    batches = Batches(runner, args.context_len)
    shapes = [(f"decode B={b}", batches.decode(b)) for b in args.batch_sizes]
    shapes += [(f"prefill {p}", batches.prefill(p)) for p in args.prefill_lens]
    # Shapes none of the timed ones share, so "first" below is the cost of a new shape alone.
    variants = [("", False)] + [(" compiled", True)] * args.compile
    start = time.perf_counter()
    for _, compiled in variants:
        step(runner, batches.prefill(7), compiled)
        step(runner, batches.decode(3), compiled)
    print(f"warm-up on other shapes: {time.perf_counter() - start:.1f} s")
    for rep in range(args.repeats):
        for name, batch in tqdm(shapes, desc=f"repeat {rep + 1}/{args.repeats}", leave=False):
            for label, compiled in variants:
                first, median, cpu = time_step(runner, batch, args.iters, compiled)
                load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                tqdm.write(
                    f"  {name + label:<23} first {first:9.2f} ms   median {median:8.2f} ms   cpu {cpu:8.2f} ms"
                    f"   load {load}"
                )
                if args.profile and rep == 0:
                    profile_step(runner, batch, max(3, args.iters // 4), compiled)


if __name__ == "__main__":
    main()
