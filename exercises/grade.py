"""Grade exercises with the chapters' own tests: one pytest run, a score per exercise.

    python exercises/grade.py                                  # the stubs in exercises/
    python exercises/grade.py --exercises-dir submissions/ada  # one student's copy of exercises/
    python exercises/grade.py --chapter 01_paged_kv --json ada.json
    python exercises/grade.py --impl reference                 # the book itself: all must pass

One pytest run, in a fresh interpreter (so one submission cannot leak into the next), runs the
graded chapters' tests with ``--impl=student`` and writes a JUnit XML report that this script
reads. An exercise scores the fraction of its tests that passed; a test that failed with the
stub's own ``NotImplementedError`` is reported as "not attempted". The chapter's other tests
(property tests, demos: those no exercise lists) run too, with all of the chapter's exercises
swapped in, and are reported on their own line per chapter, so a full score never hides code
that breaks the rest of the chapter. Those marked slow (demos, chapter 07's end-to-end runs)
only run with ``--slow``; ``--exercise-tests-only`` skips the other tests altogether.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import exercise_plugin as ep


@dataclass
class TestResult:
    nodeid: str
    outcome: str  # "passed", "failed", "error" or "skipped"
    message: str = ""


@dataclass
class ExerciseScore:
    id: str
    chapter: str
    target: str
    passed: int = 0
    total: int = 0
    not_attempted: bool = False
    tests: list[TestResult] = field(default_factory=list)


def _nodeid(case: ET.Element) -> str:
    """Rebuild pytest's node id from a JUnit testcase (classname is the dotted file path)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    # The file part ends at the first component that names a test module; the rest are classes.
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            path = "/".join(parts[: i + 1]) + ".py"
            return "::".join([path, *parts[i + 1 :], name])
    return f"{classname}::{name}"


@dataclass
class OtherTests:
    """The tests of one chapter that no exercise lists, run with all its exercises swapped in."""

    chapter: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    tests: list[TestResult] = field(default_factory=list)


def run_tests(
    exercises: list[ep.Exercise],
    impl: str,
    exercises_dir: Path | None,
    timeout: float = 3600,
    other_tests: bool = False,
    slow: bool = False,
) -> dict[str, TestResult]:
    """Run the tests of ``exercises`` in one fresh pytest process; results keyed by node id.

    With ``other_tests``, every test of their chapters runs, the unlisted ones included (those
    marked slow only with ``slow``).
    """
    if other_tests:
        paths = list(dict.fromkeys(ex.chapter + "/" for ex in exercises))
        only = [] if slow else ["--skip-slow-unlisted"]
    else:
        # Test files plus --exercise (which deselects every other test), not node ids: pytest
        # gives up on the whole run when one named node cannot be collected.
        paths = list(dict.fromkeys(t.split("::")[0] for ex in exercises for t in ex.tests))
        only = ["--exercise=" + ",".join(ex.id for ex in exercises)]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *paths,
            *only,
            f"--impl={impl}",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={report}",
            "--continue-on-collection-errors",
        ]  # a broken test file must not hide the others
        if exercises_dir is not None:
            cmd.append(f"--exercises-dir={exercises_dir}")
        proc = subprocess.run(cmd, cwd=ep.ROOT, capture_output=True, text=True, timeout=timeout)
        if not report.exists():
            raise RuntimeError(f"pytest wrote no report:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        results = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    message = (el.get("message") or "") + "\n" + (el.text or "")
                    break
            nodeid = _nodeid(case)
            results[nodeid] = TestResult(nodeid, outcome, message.strip())
        return results


def score(exercises: list[ep.Exercise], results: dict[str, TestResult]) -> list[ExerciseScore]:
    """Each exercise's mark: its own tests among ``results``."""
    scores = []
    for ex in exercises:
        s = ExerciseScore(ex.id, ex.chapter, ex.target)
        s.tests = [r for nodeid, r in results.items() if ex.selects(nodeid)]
        s.total = len(s.tests)
        s.passed = sum(r.outcome == "passed" for r in s.tests)
        s.not_attempted = s.total > 0 and all(ex.message in r.message for r in s.tests)
        scores.append(s)
    return scores


def others(exercises: list[ep.Exercise], results: dict[str, TestResult]) -> list[OtherTests]:
    """Per chapter of ``exercises``, the results of the tests that no exercise lists."""
    listed = ep.load_exercises()
    out = []
    for chapter in dict.fromkeys(ex.chapter for ex in exercises):
        o = OtherTests(chapter)
        o.tests = [
            r
            for nodeid, r in results.items()
            if nodeid.startswith(chapter + "/") and not any(ex.selects(nodeid) for ex in listed)
        ]
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
    other_tests: bool = True,
    slow: bool = False,
) -> tuple[list[ExerciseScore], list[OtherTests]]:
    """Scores of every exercise of ``chapters`` (all chapters with a registry by default; only
    ``ids`` if given) and, with ``other_tests``, the results of their chapters' other tests (the
    ones marked slow too if ``slow``)."""
    exercises = [
        ex for ex in ep.load_exercises() if (not chapters or ex.chapter in chapters) and (not ids or ex.id in ids)
    ]
    if not exercises:
        return [], []
    # One pytest run for all of them: torch and the chapters are imported once.
    results = run_tests(exercises, impl, exercises_dir, other_tests=other_tests, slow=slow)
    return score(exercises, results), others(exercises, results) if other_tests else []


def grade(
    impl: str = "student",
    exercises_dir: Path | None = None,
    chapters: list[str] | None = None,
    ids: list[str] | None = None,
) -> list[ExerciseScore]:
    """Scores of the exercises alone (their own tests only): what ``grade_all`` gives, faster."""
    return grade_all(impl, exercises_dir, chapters, ids, other_tests=False)[0]


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
    parser.add_argument("--exercise", action="append", help="grade only this exercise, e.g. 01.3 (repeatable)")
    parser.add_argument(
        "--exercise-tests-only",
        action="store_true",
        help="skip the chapters' other tests (those no exercise lists): a quicker run",
    )
    parser.add_argument(
        "--slow",
        action="store_true",
        help="also run the other tests marked slow (the demos, chapter 07's end-to-end runs: many minutes)",
    )
    parser.add_argument("--json", type=Path, help="also write the scores, test by test, as JSON")
    args = parser.parse_args(argv)
    scores, other = grade_all(
        args.impl,
        args.exercises_dir.resolve() if args.exercises_dir else None,
        args.chapter,
        args.exercise,
        other_tests=not args.exercise_tests_only,
        slow=args.slow,
    )
    print(f"{'exercise':<9} {'target':<66} {'passed':>8}  note")
    for s in scores:
        note = (
            "not run: its tests failed to collect"
            if s.total == 0
            else "not attempted"
            if s.not_attempted
            else ""
            if s.passed == s.total
            else "incomplete"
        )
        print(f"{s.id:<9} {s.target:<66} {s.passed:>3}/{s.total:<4}  {note}")
    full = sum(s.passed == s.total > 0 for s in scores)
    print(f"\n{full}/{len(scores)} exercises complete")
    slow_note = "" if args.slow else " (those marked slow not run: --slow)"
    for o in other:
        print(f"{o.chapter}: other tests of the chapter: {o.passed} passed, {o.failed} failed" + slow_note)
        for r in o.tests:
            if r.outcome not in ("passed", "skipped"):
                print(f"  {r.outcome}: {r.nodeid}")
    if args.json:
        report = {"exercises": [asdict(s) for s in scores], "other_tests": [asdict(o) for o in other]}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
