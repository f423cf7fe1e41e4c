"""Run every GPU check of the book on a lent machine as it is, and write what each found.

``bash 07_engine/gpu_check.sh [--phase 1|2] [--dry-run] OUT_DIR`` is the way in (it sets the
import path this needs; ``07_engine/gpu_check.md`` lists the outputs). Phase 1 checks correctness
(versions, ``pytest -m cuda``, the Triton kernels, greedy parity), phase 2 measures (decode step
against the bandwidth floor, profile, memory, nano-vllm's benchmark); each fits one 10-minute
call. Every step runs in its own process under a time limit that the phase's ``--budget-s``
also bounds; a failed step is recorded and the next one runs. ``OUT_DIR/summary.json`` and
``summary.md`` hold each step's status (ok, failed, timeout, skipped), seconds and log.

``--dry-run`` does on a CPU whatever needs no CUDA: a tiny checkpoint and tokenizer, each step's
program at tiny sizes (the Triton kernels in the interpreter), the cuda tests collected (they
skip), bench.py's engine and transformers runs on a tiny CPU workload (``--gpu`` needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS_PY = "07_engine/benchmarks/gpu_check_steps.py"
SKIPPED = 77  # gpu_check_steps.SKIPPED, kept here so the driver imports nothing heavy
# Test files holding cuda-marked tests; naming them keeps the run clear of tests whose imports
# need what a bare machine lacks (the server's FastAPI).
CUDA_TEST_FILES = (
    "02_page_attention/test_attention_backends.py",
    "02_page_attention/test_flash_attention.py",
    "05_spec_decode/test_spec_rejection_sampler.py",
    "07_engine/tests/test_cuda_graph.py",
    "07_engine/tests/test_engine_api.py",
    "07_engine/tests/test_kv_sizing.py",
    "07_engine/tests/test_tensor_parallel.py",
)


@dataclass
class Step:
    """One program of the check: ``args`` after the interpreter, run from the repository root."""

    name: str
    phase: int
    args: list[str]
    timeout_s: int
    outputs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def plan(out: Path, model_dir: Path, dry_run: bool) -> list[Step]:
    """Every step of both phases, in the order they run."""
    dry = ["--dry-run"] if dry_run else []
    pytest_args = ["-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
    checkpoint = [STEPS_PY, "checkpoint", str(model_dir), *(["--tiny"] if dry_run else [])]
    bench_args = ["--gpu", "--model", str(model_dir), "--hf-batch-sizes", "256", "--json", str(out / "bench.json")]
    if dry_run:  # --gpu needs CUDA; the same engine and transformers runners, on the CPU, tiny
        bench_args = ["--model", str(model_dir), "--num-requests", "4", "--input-len", "4", "8"]
        bench_args += ["--output-len", "2", "4", "--hf-batch-sizes", "4", "--hf-dtypes", "float32"]
        bench_args += ["--dtype", "float32", "--max-num-seqs", "4", "--json", str(out / "bench.json")]
    return [
        Step("versions", 1, [STEPS_PY, "versions", str(out)], 60, ["versions.json"]),
        Step("checkpoint", 1, checkpoint, 240),
        Step(
            "pytest_cuda",
            1,
            [*pytest_args, "--junitxml", str(out / "pytest_cuda.xml"), *CUDA_TEST_FILES],
            240,
            ["pytest_cuda.xml"],
        ),
        # The interpreter runs the kernels on a CPU; the variable must be set before they are defined.
        Step(
            "kernels",
            1,
            [STEPS_PY, "kernels", str(out), *dry],
            150,
            ["kernels.json"],
            {"TRITON_INTERPRET": "1"} if dry_run else {},
        ),
        Step("parity", 1, [STEPS_PY, "parity", str(model_dir), str(out), *dry], 180, ["parity.json"]),
        Step("checkpoint", 2, checkpoint, 240),
        Step(
            "decode",
            2,
            [STEPS_PY, "decode", str(model_dir), str(out), *dry],
            150,
            ["decode.json", "profile_decode.txt"],
        ),
        Step("bench", 2, ["07_engine/benchmarks/bench.py", *bench_args], 420, ["bench.json"]),
    ]


def run_step(step: Step, out: Path, deadline: float) -> dict:
    """Run one step with its log in ``out/logs``; its record for the summary."""
    log = out / "logs" / f"phase{step.phase}_{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    timeout = max(1, min(step.timeout_s, int(deadline - time.time())))
    # A child runs as this process does: with -S too when site-packages are off (the kit's test).
    cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), *step.args]
    record = {"step": step.name, "phase": step.phase, "log": str(log.relative_to(out)), "timeout_s": timeout}
    start = time.time()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(
                cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env={**os.environ, **step.env}
            ).returncode
            status = {0: "ok", SKIPPED: "skipped"}.get(rc, "failed")
            record["returncode"] = rc
        except subprocess.TimeoutExpired:
            status = "timeout"
    record.update(status=status, seconds=round(time.time() - start, 1))
    # A step's own verdict ("result: ...") where it prints one, else its last line (pytest's tally).
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()[1:] if line.strip()]
    verdicts = [line for line in lines if line.startswith("result:")]
    record["note"] = (verdicts or lines or [""])[-1][:200]
    record["outputs"] = [o for o in step.outputs if (out / o).exists()]
    print(f"[{status:>7}] {step.name:<12} {record['seconds']:7.1f} s  {record['note']}", flush=True)
    return record


def write_summary(out: Path, records: list[dict], dry_run: bool) -> bool:
    """``summary.json`` (merged with an earlier phase's in the same folder) and ``summary.md``;
    whether every step passed or was skipped."""
    path = out / "summary.json"
    earlier = json.loads(path.read_text())["steps"] if path.exists() else []
    ran = {(r["step"], r["phase"]) for r in records}
    steps = [r for r in earlier if (r["step"], r["phase"]) not in ran] + records
    summary = {"dry_run": dry_run, "steps": steps, "ok": all(r["status"] in ("ok", "skipped") for r in steps)}
    path.write_text(json.dumps(summary, indent=2) + "\n")
    table = ["| phase | step | status | seconds | note |", "| --- | --- | --- | --- | --- |"]
    for r in steps:
        note = r["note"].replace("|", "\\|")
        table.append(f"| {r['phase']} | {r['step']} | {r['status']} | {r['seconds']} | {note} |")
    (out / "summary.md").write_text("\n".join(table) + "\n")
    print("\n" + "\n".join(table))
    return summary["ok"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for every output (created)")
    parser.add_argument("--phase", type=int, choices=(1, 2), help="run one phase (default: both)")
    parser.add_argument("--dry-run", action="store_true", help="what needs no CUDA, on a CPU, at tiny sizes")
    parser.add_argument(
        "--models",
        type=Path,
        help="where the checkpoint is built (default: .models/gpu-check, kept between the phases' calls; "
        "OUT/models with --dry-run)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=570, help="seconds one phase may take in all (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        raise SystemExit(f"--budget-s must be positive, got {args.budget_s}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    models = (args.models or (out / "models" if args.dry_run else REPO / ".models" / "gpu-check")).resolve()
    models.mkdir(parents=True, exist_ok=True)
    model_dir = models / ("qwen3-tiny-random" if args.dry_run else "qwen3-0.6b-random")
    records = []
    for phase in (args.phase,) if args.phase else (1, 2):
        deadline = time.time() + args.budget_s
        for step in (s for s in plan(out, model_dir, args.dry_run) if s.phase == phase):
            if time.time() >= deadline:
                records.append(
                    dict(
                        step=step.name,
                        phase=phase,
                        status="skipped",
                        seconds=0.0,
                        note="phase budget spent",
                        outputs=[],
                        log="",
                    )
                )
                continue
            records.append(run_step(step, out, deadline))
    # Non-zero when a step failed or timed out, after every step has had its turn.
    return 0 if write_summary(out, records, args.dry_run) else 1


if __name__ == "__main__":
    sys.exit(main())
