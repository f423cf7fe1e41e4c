"""Run the book's essential GPU checks on a lent machine as it is, in one call, and write what each found.

``bash 07_engine/gpu_check.sh [--quick] [--dry-run] [--steps A,B] OUT_DIR`` is the way in (it sets
the import path this needs; ``07_engine/gpu_check.md`` lists the steps and their time limits).
Every step runs in its own process group under its own time limit; the limits of the full plan
add up to 400 s (7 minutes less start-up), those of ``--quick`` to 175 s (:func:`planned_seconds`).
A step that fails or times out is recorded and the next one runs.

``OUT_DIR`` receives few files, each rewritten as soon as a step finishes, so that a call cut off
by its own time limit still brings back every step that ran: ``summary.md`` (the table),
``summary.json`` (each step's status, seconds, limit, one-line result and its full JSON report),
``logs.txt`` (every step's output), ``pytest_cuda.xml`` and ``profile_decode.txt``. The step
running when the call was cut off is marked ``running``.

``--dry-run`` runs what needs no CUDA on a CPU: a tiny checkpoint, each step's program at tiny
sizes (the Triton kernels in the interpreter), the cuda tests collected (they skip), bench.py's
GPU code on a tiny CPU workload.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS_PY = "07_engine/benchmarks/gpu_check_steps.py"
BENCH_PY = "07_engine/benchmarks/bench.py"
SKIPPED = 77  # gpu_check_steps.SKIPPED, kept here so the driver imports nothing heavy
# The step files whose text is copied into OUT_DIR beside the summary.
COPIED = ("pytest_cuda.xml", "profile_decode.txt")
# The directories whose test files the kit searches for cuda-marked tests.
TEST_DIRS = ("01_paged_kv", "02_page_attention", "03_prefix_cache", "04_scheduler", "05_spec_decode")
TEST_DIRS += ("06_chunked_prefill", "07_engine/tests", "tests")
# The cuda marker where it marks something: a decorator, a parameter's marks, a module's pytestmark.
CUDA_MARK = re.compile(r"(@|marks=\[?|pytestmark\s*=\s*\[?)pytest\.mark\.cuda\b")


def cuda_test_files() -> list[str]:
    """Every test file holding a ``cuda``-marked test (the marker is the one source of truth),
    relative to the repository. Naming them, rather than the whole tree, keeps ``pytest -m cuda``
    clear of test files whose imports need what a bare machine lacks (the server's FastAPI)."""
    found = []
    for folder in TEST_DIRS:
        for path in sorted((REPO / folder).glob("test_*.py")):
            if CUDA_MARK.search(path.read_text()):
                found.append(str(path.relative_to(REPO)))
    return found


@dataclass
class Step:
    """One program of the check: ``args`` after the interpreter, run from the repository root,
    killed (with its children) after ``timeout_s``. ``report``: the JSON file it writes in the
    work folder, embedded in ``summary.json``."""

    name: str
    args: list[str]
    timeout_s: int
    report: str | None = None
    env: dict[str, str] = field(default_factory=dict)


# A dry run's limits are the GPU's times this: two CPU cores, Triton's interpreter, at tiny sizes.
DRY_RUN_SLACK = 4


def plan(work: Path, model_dir: Path, dry_run: bool, quick: bool = False) -> list[Step]:
    """The steps of one call, in the order they run, with their time limits on an H100
    (:data:`DRY_RUN_SLACK` times those with ``dry_run``)."""
    steps = _plan(work, model_dir, dry_run, quick)
    for step in steps if dry_run else ():
        step.timeout_s *= DRY_RUN_SLACK
    return steps


def _plan(work: Path, model_dir: Path, dry_run: bool, quick: bool) -> list[Step]:
    dry = ["--dry-run"] if dry_run else []
    pytest_args = ["-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
    checkpoint = [STEPS_PY, "checkpoint", str(model_dir), *(["--tiny"] if dry_run else [])]
    bench = [BENCH_PY, "--gpu", *dry, "--model", str(model_dir)]
    # The interpreter runs the kernels on a CPU; the variable must be set before they are defined.
    interpret = {"TRITON_INTERPRET": "1"} if dry_run else {}
    versions = Step("versions", [STEPS_PY, "versions", str(work)], 15, "versions.json")
    build = Step("checkpoint", checkpoint, 40)
    parity = Step("parity", [STEPS_PY, "parity", str(model_dir), str(work), *dry, *(["--quick"] * quick)], 35)
    parity.report = "parity.json"
    decode = Step("decode", [STEPS_PY, "decode", str(model_dir), str(work), *dry], 35, "decode.json")

    def bench_step(name: str, timeout_s: int, *args: str) -> Step:
        return Step(name, [*bench, *args, "--json", str(work / f"{name}.json")], timeout_s, f"{name}.json")

    if quick:
        # A second try after a full call went wrong: what says most in three minutes.
        graphs = bench_step("bench_graphs", 50, "--gpu-modes", "graphs", "--num-requests", "64", "--hf-batch-sizes")
        return [versions, build, parity, decode, graphs]
    parity.timeout_s = 45
    decode.timeout_s = 40
    cuda_tests = [*pytest_args, "--junitxml", str(work / "pytest_cuda.xml"), *cuda_test_files()]
    return [
        versions,
        build,
        Step("pytest_cuda", cuda_tests, 70, env=interpret),
        Step("kernels", [STEPS_PY, "kernels", str(work), *dry], 35, "kernels.json", interpret),
        parity,
        decode,
        # nano-vllm's workload: the engine with CUDA graphs (and nano-vllm where flash-attn is),
        # then eager, then transformers on the first 128 requests in one batch of 128 (each batch of
        # 128 costs what its longest output does; 256 at once would want ~56 GiB of KV cache).
        bench_step("bench_graphs", 60, "--gpu-modes", "graphs", "--hf-batch-sizes"),
        bench_step("bench_eager", 50, "--gpu-modes", "eager", "--gpu-peers", "--hf-batch-sizes"),
        bench_step(
            "bench_transformers",
            45,
            "--gpu-modes",
            "--hf-batch-sizes",
            "4" if dry_run else "128",
            "--hf-max-requests",
            "4" if dry_run else "128",
        ),
    ]


def planned_seconds(quick: bool) -> int:
    """The sum of a call's step limits (the dry run's plan has the same steps)."""
    return sum(s.timeout_s for s in plan(Path("work"), Path("model"), dry_run=False, quick=quick))


def run_step(step: Step, work: Path) -> tuple[dict, str]:
    """Run one step in its own process group with its output in ``work/logs``; its record for the
    summary and its log. A timeout kills the whole group (pytest's and bench.py's children too)."""
    log_path = work / "logs" / f"{step.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # A child runs as this process does: with -S too when site-packages are off (the kit's test).
    cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), *step.args]
    record: dict = {"step": step.name, "timeout_s": step.timeout_s}
    start = time.time()
    with log_path.open("w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **step.env},
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=step.timeout_s)
            status = {0: "ok", SKIPPED: "skipped"}.get(rc, "failed")
            record["returncode"] = rc
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
    record.update(status=status, seconds=round(time.time() - start, 1))
    text = log_path.read_text(errors="replace")
    # A step's own verdict ("result: ...") where it prints one, else its last line (pytest's tally).
    lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
    verdicts = [line for line in lines if line.startswith("result:")]
    record["note"] = "; ".join(v.removeprefix("result: ") for v in verdicts)[:400] or (lines or [""])[-1][:200]
    if step.report and (work / step.report).exists():
        record["report"] = json.loads((work / step.report).read_text())
    took = f"{record['seconds']:6.1f} s of {step.timeout_s:>3}"
    print(f"[{status:>7}] {step.name:<18} {took}  {record['note']}", flush=True)
    return record, text


def _write(path: Path, text: str) -> None:
    """Replace ``path`` whole (a reader never sees half a file, even if the call is cut off)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_summary(out: Path, records: list[dict], meta: dict) -> bool:
    """``summary.json`` and ``summary.md`` of the steps so far; whether each passed or was skipped."""
    ok = all(r["status"] in ("ok", "skipped") for r in records)
    _write(out / "summary.json", json.dumps({**meta, "ok": ok, "steps": records}, indent=2, default=str) + "\n")
    table = ["| step | status | seconds | limit | result |", "| --- | --- | --- | --- | --- |"]
    for r in records:
        note = r.get("note", "").replace("|", "\\|")
        table.append(f"| {r['step']} | {r['status']} | {r.get('seconds', '')} | {r['timeout_s']} | {note} |")
    _write(out / "summary.md", "\n".join(table) + "\n")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the summary, logs and reports (created)")
    parser.add_argument("--quick", action="store_true", help=f"the short plan ({planned_seconds(True)} s of limits)")
    parser.add_argument("--dry-run", action="store_true", help="what needs no CUDA, on a CPU, at tiny sizes")
    parser.add_argument("--steps", help="comma-separated steps of the plan to run (default: all), e.g. parity,decode")
    parser.add_argument(
        "--models",
        type=Path,
        help="where the checkpoint is built (default: .models/gpu-check, kept while the machine stays warm; "
        "a temporary folder with --dry-run)",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        models = (args.models or (work / "models" if args.dry_run else REPO / ".models" / "gpu-check")).resolve()
        models.mkdir(parents=True, exist_ok=True)
        model_dir = models / ("qwen3-tiny-random" if args.dry_run else "qwen3-0.6b-random")
        steps = plan(work, model_dir, args.dry_run, args.quick)
        if args.steps:
            chosen = args.steps.split(",")
            unknown = sorted(set(chosen) - {s.name for s in steps})
            if unknown:
                parser.error(f"--steps: {unknown} not in this plan ({', '.join(s.name for s in steps)})")
            steps = [s for s in steps if s.name in chosen]
        meta = {"dry_run": args.dry_run, "quick": args.quick, "planned_s": sum(s.timeout_s for s in steps)}
        print(f"{len(steps)} steps, {meta['planned_s']} s of time limits in all", flush=True)
        records: list[dict] = []
        logs: list[str] = []
        for step in steps:
            # Marked before it starts: a call cut off mid-step still says which step it was in.
            write_summary(out, [*records, {"step": step.name, "status": "running", "timeout_s": step.timeout_s}], meta)
            record, log = run_step(step, work)
            records.append(record)
            logs.append(f"===== {step.name}: {record['status']} in {record['seconds']} s =====\n{log}\n")
            _write(out / "logs.txt", "".join(logs))
            for name in COPIED:
                if (work / name).exists():
                    shutil.copyfile(work / name, out / name)
            write_summary(out, records, meta)
    print("\n" + (out / "summary.md").read_text())
    # Non-zero when a step failed or timed out, after every step has had its turn.
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
