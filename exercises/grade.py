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
that call its code. Which chapter tests run: those that call some exercise, cheapest first within
a budget of seconds per chapter, as trace_calls.py's map of the chapter says (a minute or two a
chapter); ``--all-chapter-tests``
every one not marked slow (``--slow``: those too). A test that fails while calling none of the
student's code fails with the book's code too, and is reported as such. ``--exercise`` grades
only those exercises' own tests, with them alone in place: the check in seconds while working.
"not attempted" means every own test failed with the stub's own ``NotImplementedError``.
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
import trace_calls

CHAPTER_TESTS = ("none", "quick", "all")
# Each test run's limit, far past the slowest test's time with correct code on a loaded machine
# (test_compile's compiler-failure test took 118 s beside seven busy processes on 2 cores): code
# that hangs fails instead of holding up the grade, and a slow machine costs nobody marks.
TEST_TIMEOUT_S = 600


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
    chapter_tests: str = "none",
    slow: bool = False,
    graded_by: str = "both",
    draw: str | None = None,
) -> list[dict]:
    """Run the tests of ``exercises`` in one fresh pytest process; the plugin's report entries.

    ``chapter_tests`` "none": their own tests (``graded_by``: hand-written, differential or both),
    each with its exercise alone in place. "quick": their own tests and the quick chapter tests
    that call an exercise (trace_calls.py's maps), "all": every test of their chapters (those
    marked slow only with ``slow``); both with all the chapter's exercises in place and failures
    charged.
    """
    if chapter_tests not in CHAPTER_TESTS:
        raise ValueError(f"chapter_tests must be one of {CHAPTER_TESTS}, got {chapter_tests!r}")
    chapters = list(dict.fromkeys(ex.chapter for ex in exercises))
    selection: list[str] = []
    if chapter_tests == "none":
        # Test files plus --exercise (which deselects every other test), not node ids: pytest
        # gives up on the whole run when one named node cannot be collected.
        paths = list(dict.fromkeys(t.split("::")[0] for ex in exercises for t in ex.own_tests(graded_by)))
        only = ["--exercise=" + ",".join(ex.id for ex in exercises), f"--graded-by={graded_by}"]
        swap = "own"
    else:
        paths = [chapter + "/" for chapter in chapters]
        only = [] if slow else ["--skip-slow-unlisted"]
        swap = "all"
        if chapter_tests == "quick":
            everyone = [ex for ex in ep.load_exercises() if ex.chapter in chapters]
            selection = [t for ex in everyone for t in ex.own_tests()]
            selection += [t for chapter in chapters for t in trace_calls.quick_tests(chapter)]
    if not paths:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        if selection:
            (Path(tmp) / "tests.txt").write_text("\n".join(selection) + "\n")
            only.append(f"--only-tests={Path(tmp) / 'tests.txt'}")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *paths,
            *only,
            f"--impl={impl}",
            f"--swap={swap}",
            f"--grade-report={report}",
            f"--test-timeout={TEST_TIMEOUT_S}",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",  # a broken test file must not hide the others
        ]
        if exercises_dir is not None:
            cmd.append(f"--exercises-dir={exercises_dir}")
        if draw is not None:
            cmd.append(f"--draw={draw}")
        proc = subprocess.run(cmd, cwd=ep.ROOT, capture_output=True, text=True, timeout=timeout, env=ep.grading_env())
        if proc.returncode == 5:  # nothing collected
            return []
        # 0: all passed, 1: some failed; anything else (interrupted, an internal error) left tests
        # unrun, and marks from part of the tests would be wrong.
        if proc.returncode not in (0, 1) or not report.exists():
            raise RuntimeError(
                f"pytest stopped early (exit code {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
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
    chapter_tests: str = "quick",
    slow: bool = False,
    graded_by: str = "both",
    draw: str | None = None,
) -> tuple[list[ExerciseScore], list[OtherTests]]:
    """Marks of every exercise of ``chapters`` (all chapters with a registry by default; only
    ``ids`` if given) and, unless ``chapter_tests`` is "none", the results of the chapter tests
    that ran besides the exercises' own (see :func:`run_tests`)."""
    exercises = [
        ex for ex in ep.load_exercises() if (not chapters or ex.chapter in chapters) and (not ids or ex.id in ids)
    ]
    if not exercises:
        return [], []
    # One pytest run for all of them: torch and the chapters are imported once.
    entries = run_tests(
        exercises, impl, exercises_dir, chapter_tests=chapter_tests, slow=slow, graded_by=graded_by, draw=draw
    )
    return score(exercises, entries), others(exercises, entries) if chapter_tests != "none" else []


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
    return grade_all(impl, exercises_dir, chapters, ids, chapter_tests="none", graded_by=graded_by, draw=draw)[0]


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
        help="only every exercise's own tests, each exercise alone in place: a quicker run",
    )
    parser.add_argument(
        "--all-chapter-tests",
        action="store_true",
        help="every chapter test not marked slow, not only the quick ones that call an exercise "
        "(chapter 07's engine-level tests: ten minutes and more)",
    )
    parser.add_argument(
        "--slow",
        action="store_true",
        help="with --all-chapter-tests, also the tests marked slow (the demos, chapter 07's end-to-end runs)",
    )
    parser.add_argument("--json", type=Path, help="also write the marks, test by test, as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    scores, other = grade_all(
        args.impl,
        args.exercises_dir.resolve() if args.exercises_dir else None,
        args.chapter,
        args.exercise,
        chapter_tests="none"
        if args.exercise_tests_only or args.exercise
        else "all"
        if args.all_chapter_tests
        else "quick",
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
    which = "all" if args.all_chapter_tests else "the cheapest that call an exercise"
    slow_note = " (those marked slow too)" if args.slow else ""
    for o in other:
        print(f"{o.chapter}: the chapter's other tests ({which}{slow_note}): {o.passed} passed, {o.failed} failed")
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
