"""Which exercises each chapter test calls, and how long it takes: the map grade.py picks tests by.

Runs a chapter's tests (those not marked slow) with the book's own code, every exercise's function
wrapped to note its calls (exercise_plugin.py's ``--grade-report``), and writes
``exercises/<chapter>/chapter_tests.json``: for every test, the exercises whose code it calls and
its duration on this machine. grade.py then runs, besides each exercise's own tests, the chapter
tests that call some exercise, the cheapest first within a budget of traced seconds per chapter
(:data:`QUICK_BUDGET_S`), so a chapter grades in a minute or two; ``grade.py --all-chapter-tests``
runs every one.

    python exercises/trace_calls.py                       # every chapter (chapter 07: half an hour, 2 busy cores)
    python exercises/trace_calls.py --chapter 04_scheduler
    python exercises/trace_calls.py --check               # which tests the maps do not know yet
    python exercises/trace_calls.py --new-only            # trace only those
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import exercise_plugin as ep

MAP_NAME = "chapter_tests.json"
# The chapter tests a default grade runs besides the exercises' own: those that call an exercise,
# cheapest first, while their traced seconds add up to at most this much per chapter. A budget, not
# a limit per test: a busier machine at tracing time slows every test alike and changes little of
# the choice, where a fixed second dropped a chapter's random workloads when they took 1.1 s.
QUICK_BUDGET_S = 30.0
# The tests a map covers: those a grade on a CPU runs (the slow ones only with --slow, the CUDA ones
# never: they skip there).
MARKERS = "not slow and not cuda"


def map_path(chapter: str) -> Path:
    return ep.EXERCISES_DIR / chapter / MAP_NAME


def load_map(chapter: str) -> dict[str, dict]:
    """``{nodeid: {"calls": [exercise ids], "seconds": s}}`` of ``chapter`` (empty if not traced)."""
    path = map_path(chapter)
    return json.loads(path.read_text())["tests"] if path.exists() else {}


def quick_tests(chapter: str) -> list[str]:
    """The chapter tests (no exercise's own) that call some exercise, cheapest first, within
    :data:`QUICK_BUDGET_S` of traced seconds."""
    own = [ex for ex in ep.load_exercises() if ex.chapter == chapter]
    tests = load_map(chapter).items()
    calling = sorted((t["seconds"], n) for n, t in tests if t["calls"] and not any(ex.selects(n) for ex in own))
    chosen, spent = [], 0.0
    for seconds, nodeid in calling:
        spent += seconds
        if spent > QUICK_BUDGET_S:
            break
        chosen.append(nodeid)
    return chosen


def machine() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def trace(chapter: str, only: set[str] | None = None, timeout: float = 3600) -> dict[str, dict]:
    """Run ``chapter``'s tests (:data:`MARKERS`; only the node ids ``only`` if given) with the
    book's code and note every test's calls.

    A test that fails with the book's code is noted too, and named on stderr: its calls are what
    the book's code makes, and on a busy machine a test with a time limit can fail by itself.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        cmd = [sys.executable, "-m", "pytest", f"{chapter}/", "-m", MARKERS, "--impl=reference",
               f"--grade-report={report}", "-q", "-p", "no:cacheprovider"]  # fmt: skip
        if only is not None:
            (Path(tmp) / "tests.txt").write_text("".join(f"{n}\n" for n in sorted(only)))
            cmd.append(f"--only-tests={Path(tmp) / 'tests.txt'}")
        proc = subprocess.run(cmd, cwd=ep.ROOT, capture_output=True, text=True, timeout=timeout, env=ep.grading_env())
        if not report.exists():
            raise RuntimeError(f"pytest wrote no report:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        entries = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    for e in entries:
        if e["outcome"] == "failed":
            print(f"{e['nodeid']} fails with the book's code: run it alone to see why", file=sys.stderr)
    return {e["nodeid"]: {"calls": e["called"], "seconds": e["duration"]} for e in entries if e["outcome"] != "skipped"}


def write(chapter: str, tests: dict[str, dict]) -> Path:
    path = map_path(chapter)
    header = {
        "about": "written by exercises/trace_calls.py: the exercises each test calls, and its seconds on the machine",
        "machine": f"{machine()}, {len(os.sched_getaffinity(0))} cores",
        "tests": dict(sorted(tests.items())),
    }
    path.write_text(json.dumps(header, indent=1) + "\n")
    return path


def collected(chapters: list[str]) -> set[str]:
    """Node ids of the tests of ``chapters`` a map covers (:data:`MARKERS`), as pytest collects them now
    (one collection: torch and the chapters are imported once)."""
    cmd = [sys.executable, "-m", "pytest", *(f"{c}/" for c in chapters), "-m", MARKERS, "--collect-only", "-q",
           "-p", "no:cacheprovider"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ep.ROOT, capture_output=True, text=True, env=ep.grading_env())
    if proc.returncode != 0:
        raise RuntimeError(f"collecting {chapters} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def stale(chapters: list[str]) -> list[str]:
    """What the maps of ``chapters`` do not know yet, or list in vain: empty when they are current."""
    now = collected(chapters)
    known = {nodeid for chapter in chapters for nodeid in load_map(chapter)}
    return [f"not traced yet: {n}" for n in sorted(now - known)] + [
        f"traced but gone: {n}" for n in sorted(known - now)
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapter", action="append", help="only this chapter (repeatable)")
    parser.add_argument("--check", action="store_true", help="list the tests each map lacks or lists in vain")
    parser.add_argument(
        "--new-only",
        action="store_true",
        help="trace only the tests a map does not know yet, and drop those gone (minutes, not chapter 07's half hour)",
    )
    args = parser.parse_args(argv)
    chapters = args.chapter or sorted({ex.chapter for ex in ep.load_exercises()})
    if args.check:
        lines = stale(chapters)
        print("\n".join(lines) or f"the maps of {', '.join(chapters)} know every test")
        return 1 if lines else 0
    for chapter in chapters:
        if args.new_only:
            known, now = load_map(chapter), collected([chapter])
            tests = {n: t for n, t in known.items() if n in now} | (
                trace(chapter, now - set(known)) if now - set(known) else {}
            )
        else:
            tests = trace(chapter)
        path = write(chapter, tests).relative_to(ep.ROOT)
        print(f"{path}: {len(load_map(chapter))} tests, {len(quick_tests(chapter))} chapter tests run in a grade")
    return 0


if __name__ == "__main__":
    sys.exit(main())
