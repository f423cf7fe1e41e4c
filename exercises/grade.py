"""Grade exercises with the chapters' own tests: one pytest run, a mark per exercise.

    python exercises/grade.py                                  # the stubs in exercises/
    python exercises/grade.py --exercises-dir submissions/ada  # one student's copy of exercises/
    python exercises/grade.py --chapter 01_paged_kv --json ada.json
    python exercises/grade.py --exercise 01.3                  # one exercise's own tests: seconds
    python exercises/grade.py --impl reference                 # the book itself: all must pass

One pytest run, in a fresh interpreter (so one submission cannot leak into the next), runs the
graded chapters' tests with ``--impl=student --swap=all``: every test with all of its chapter's
exercises in place, recording which of them it calls (exercise_plugin.py). The plugin's report
gives every test's verdict for each exercise it exercised; a test that fails is run again with
each of those exercises alone, so it is charged to the ones it fails with.

An exercise's mark is the fraction of its tests that pass: its *own* tests (hand-written, and
differential: drawn inputs compared with the book's function), and the chapter's other tests
that call its code (``chapter tests``). Every chapter test not marked slow runs (``--slow``: those
too); a test that fails while calling none of the student's code fails with the book's code too
and is reported as such. ``--exercise`` grades only those exercises' own tests, with them alone
in place: the quick check while working. "not attempted" means every own test failed with the
stub's own ``NotImplementedError``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import exercise_plugin as ep


@dataclass
class TestResult:
    nodeid: str
    outcome: str  # "passed", "failed" or "skipped"
    message: str = ""


@dataclass
class ExerciseScore:
    id: str
    chapter: str
    target: str
    passed: int = 0  # own tests
    total: int = 0
    not_attempted: bool = False
    tests: list[TestResult] = field(default_factory=list)
    chapter_passed: int = 0  # the chapter's other tests that call this exercise's code
    chapter_total: int = 0
    chapter_tests: list[TestResult] = field(default_factory=list)

    @property
    def mark(self) -> float:
        """Passed over run, own and chapter tests together (0 when nothing ran)."""
        run = self.total + self.chapter_total
        return (self.passed + self.chapter_passed) / run if run else 0.0

    @property
    def full(self) -> bool:
        return self.total > 0 and self.passed == self.total and self.chapter_passed == self.chapter_total


@dataclass
class OtherTests:
    """The tests of one chapter that are no exercise's own, run with all its exercises in place."""

    chapter: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    tests: list[TestResult] = field(default_factory=list)
    charged: dict[str, list[str]] = field(default_factory=dict)  # failing test -> exercises it costs


def run_tests(
    exercises: list[ep.Exercise],
    impl: str,
    exercises_dir: Path | None,
    timeout: float = 3600,
    chapter_tests: bool = False,
    slow: bool = False,
    graded_by: str = "both",
    draw: str | None = None,
) -> list[dict]:
    """Run the tests of ``exercises`` in one fresh pytest process; the plugin's report entries.

    Without ``chapter_tests``: their own tests (``graded_by``: hand-written, differential or
    both), each with its exercise alone in place. With it: every test of their chapters (those
    marked slow only with ``slow``), with all the chapter's exercises in place and failures charged.
    """
    if chapter_tests:
        paths = list(dict.fromkeys(ex.chapter + "/" for ex in exercises))
        only = [] if slow else ["--skip-slow-unlisted"]
        swap = "all"
    else:
        # Test files plus --exercise (which deselects every other test), not node ids: pytest
        # gives up on the whole run when one named node cannot be collected.
        paths = list(dict.fromkeys(t.split("::")[0] for ex in exercises for t in ex.own_tests(graded_by)))
        only = ["--exercise=" + ",".join(ex.id for ex in exercises), f"--graded-by={graded_by}"]
        swap = "own"
    if not paths:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *paths,
            *only,
            f"--impl={impl}",
            f"--swap={swap}",
            f"--grade-report={report}",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",  # a broken test file must not hide the others
        ]
        if exercises_dir is not None:
            cmd.append(f"--exercises-dir={exercises_dir}")
        if draw is not None:
            cmd.append(f"--draw={draw}")
        proc = subprocess.run(cmd, cwd=ep.ROOT, capture_output=True, text=True, timeout=timeout)
        if not report.exists():
            if proc.returncode == 5:  # nothing collected
                return []
            raise RuntimeError(f"pytest wrote no report:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return [json.loads(line) for line in report.read_text().splitlines() if line.strip()]


def score(exercises: list[ep.Exercise], entries: list[dict]) -> list[ExerciseScore]:
    """Each exercise's mark: its own tests, and the other tests whose verdicts name it."""
    scores = []
    for ex in exercises:
        s = ExerciseScore(ex.id, ex.chapter, ex.target)
        for e in entries:
            verdict = e["verdicts"].get(ex.id)
            if ex.selects(e["nodeid"]):
                v = verdict or {"outcome": e["outcome"], "message": e["message"]}
                if v["outcome"] != "skipped":
                    s.tests.append(TestResult(e["nodeid"], v["outcome"], v["message"]))
            elif verdict is not None and verdict["outcome"] != "skipped":
                s.chapter_tests.append(TestResult(e["nodeid"], verdict["outcome"], verdict["message"]))
        s.total, s.passed = len(s.tests), sum(r.outcome == "passed" for r in s.tests)
        s.chapter_total = len(s.chapter_tests)
        s.chapter_passed = sum(r.outcome == "passed" for r in s.chapter_tests)
        s.not_attempted = s.total > 0 and all(ex.message in r.message for r in s.tests)
        scores.append(s)
    return scores


def others(exercises: list[ep.Exercise], entries: list[dict]) -> list[OtherTests]:
    """Per chapter of ``exercises``, the results of the tests that are no exercise's own."""
    listed = ep.load_exercises()
    out = []
    for chapter in dict.fromkeys(ex.chapter for ex in exercises):
        o = OtherTests(chapter)
        for e in entries:
            if not e["nodeid"].startswith(chapter + "/") or any(ex.selects(e["nodeid"]) for ex in listed):
                continue
            o.tests.append(TestResult(e["nodeid"], e["outcome"], e["message"]))
            if e["outcome"] == "failed":
                o.charged[e["nodeid"]] = sorted(i for i, v in e["verdicts"].items() if v["outcome"] == "failed")
        o.passed = sum(r.outcome == "passed" for r in o.tests)
        o.skipped = sum(r.outcome == "skipped" for r in o.tests)
        o.failed = len(o.tests) - o.passed - o.skipped
        out.append(o)
    return out


def grade_all(
    impl: str = "student",
    exercises_dir: Path | None = None,
    chapters: list[str] | None = None,
    ids: list[str] | None = None,
    chapter_tests: bool = True,
    slow: bool = False,
    graded_by: str = "both",
    draw: str | None = None,
) -> tuple[list[ExerciseScore], list[OtherTests]]:
    """Marks of every exercise of ``chapters`` (all chapters with a registry by default; only
    ``ids`` if given) and, with ``chapter_tests``, the results of their chapters' other tests."""
    exercises = [
        ex for ex in ep.load_exercises() if (not chapters or ex.chapter in chapters) and (not ids or ex.id in ids)
    ]
    if not exercises:
        return [], []
    # One pytest run for all of them: torch and the chapters are imported once.
    entries = run_tests(
        exercises, impl, exercises_dir, chapter_tests=chapter_tests, slow=slow, graded_by=graded_by, draw=draw
    )
    return score(exercises, entries), others(exercises, entries) if chapter_tests else []


def grade(
    impl: str = "student",
    exercises_dir: Path | None = None,
    chapters: list[str] | None = None,
    ids: list[str] | None = None,
    graded_by: str = "both",
    draw: str | None = None,
) -> list[ExerciseScore]:
    """Marks of the exercises on their own tests alone, each alone in place: what ``grade_all``
    gives without the chapter tests, faster."""
    return grade_all(impl, exercises_dir, chapters, ids, chapter_tests=False, graded_by=graded_by, draw=draw)[0]


def _note(s: ExerciseScore) -> str:
    if s.total == 0:
        return "not run: its tests failed to collect"
    if s.not_attempted:
        return "not attempted"
    return "" if s.full else "incomplete"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=ep.IMPLS, default="student")
    parser.add_argument(
        "--exercises-dir",
        type=Path,
        default=None,
        help="a copy of exercises/ holding the work to grade (default: exercises/)",
    )
    parser.add_argument("--chapter", action="append", help="grade only this chapter (repeatable)")
    parser.add_argument(
        "--exercise",
        action="append",
        help="grade only this exercise, e.g. 01.3, on its own tests (repeatable): the quick check",
    )
    parser.add_argument(
        "--exercise-tests-only",
        action="store_true",
        help="only every exercise's own tests, not the chapters' other tests: a quicker run",
    )
    parser.add_argument(
        "--slow",
        action="store_true",
        help="also run the chapter tests marked slow (the demos, chapter 07's end-to-end runs: many minutes)",
    )
    parser.add_argument("--json", type=Path, help="also write the marks, test by test, as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    scores, other = grade_all(
        args.impl,
        args.exercises_dir.resolve() if args.exercises_dir else None,
        args.chapter,
        args.exercise,
        chapter_tests=not (args.exercise_tests_only or args.exercise),
        slow=args.slow,
    )
    print(f"{'exercise':<9} {'target':<62} {'own':>7} {'chapter':>8} {'mark':>5}  note")
    for s in scores:
        chapter = f"{s.chapter_passed}/{s.chapter_total}" if s.chapter_total else "-"
        print(f"{s.id:<9} {s.target:<62} {s.passed:>3}/{s.total:<3} {chapter:>8} {100 * s.mark:>4.0f}%  {_note(s)}")
        for r in s.tests + s.chapter_tests:
            if r.outcome == "failed" and not s.not_attempted:
                print(f"    failed: {r.nodeid}")
    full = sum(s.full for s in scores)
    print(f"\n{full}/{len(scores)} exercises complete ({time.perf_counter() - start:.0f} s)")
    slow_note = "" if args.slow else " (those marked slow not run: --slow)"
    for o in other:
        print(f"{o.chapter}: the chapter's other tests: {o.passed} passed, {o.failed} failed" + slow_note)
        for r in o.tests:
            if r.outcome == "failed":
                charged = o.charged.get(r.nodeid)
                cost = f"costs {', '.join(charged)}" if charged else "fails with the book's code too"
                print(f"  failed: {r.nodeid} ({cost})")
    if args.json:
        report = {
            "exercises": [asdict(s) | {"mark": s.mark} for s in scores],
            "other_tests": [asdict(o) for o in other],
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
