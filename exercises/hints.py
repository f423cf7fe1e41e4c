"""Hints followed to the letter: an answer written from an exercise's hint alone gets full marks.

A hint that states a formula, a range or an order (01.3's slot formula, 06.4's positions, 07.9's
rounding, 07.S4's statistics, ...) is a promise: code that does exactly what it says is right.
``<chapter>/hints/<exercise id>_<slug>.py`` holds such an answer, written from the hint's words
(not from the book's code), with a one-line docstring saying which words it follows. ``check``
plants each into the answer key, as ``mistakes.py`` does with wrong answers, and grades its
exercise on all of its own tests (hand-written and differential): anything short of full marks
means the hint misleads, and ``tests/test_exercise_hints.py`` fails.

    python exercises/hints.py                         # every chapter
    python exercises/hints.py --chapter 06_chunked_prefill
"""

from __future__ import annotations

import argparse
import sys

import grade
import mistakes

HINTS_DIR = "hints"


def check(chapters: list[str] | None = None) -> list[tuple[mistakes.Answer, grade.ExerciseScore]]:
    """Grade every literal-hint answer of ``chapters``; each must keep full marks."""
    return mistakes.check(chapters, folder=HINTS_DIR)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapter", action="append", help="only this chapter (repeatable)")
    args = parser.parse_args(argv)
    misled = 0
    for answer, s in check(args.chapter):
        full = s.total > 0 and s.passed == s.total
        misled += not full
        print(f"{'full marks' if full else 'LOSES MARKS':<12} {s.passed}/{s.total}  {answer.name}: {answer.summary}")
        for t in s.tests:
            if t.outcome != "passed":
                print(f"    {t.outcome}: {t.nodeid}\n      " + t.message[-600:].replace("\n", "\n      "))
    print(f"\n{misled} hint(s) followed to the letter lose marks")
    return 1 if misled else 0


if __name__ == "__main__":
    sys.exit(main())
