"""The catalogue of classic wrong answers, and the check that the grader catches every one.

Each ``<chapter>/mistakes/<exercise id>_<slug>.py`` holds one wrong version of an exercise's stub
function (same name, same parameters), whose one-line docstring names the misconception: the
mistakes a learner really writes, such as a slot mapping that assumes a sequence's blocks are
contiguous. ``check`` plants each one into the answer key (``make_stubs.py --solutions``) and
grades its exercise: every mistake must lose marks, or the tests have a hole.

    python exercises/mistakes.py                         # every chapter
    python exercises/mistakes.py --chapter 01_paged_kv   # one chapter

A round plants one mistake of every exercise at once and grades them in one pytest run: an
exercise's tests swap in only that exercise (exercise_plugin.py), so the mistakes planted beside
it never reach them. An exercise with three mistakes takes three rounds.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import exercise_plugin as ep
import grade
import make_stubs

MISTAKES_DIR = "mistakes"
# Grading rounds run side by side (see check()).
ROUNDS_AT_ONCE = 2


@dataclass(frozen=True)
class Answer:
    """One catalogued answer to ``exercise``, in the file ``path``: a wrong one (``mistakes/``), or
    one that follows the exercise's hint to the letter (``hints/``, see hints.py)."""

    exercise: ep.Exercise
    path: Path

    @property
    def name(self) -> str:
        return f"{self.exercise.chapter}/{self.path.parent.name}/{self.path.name}"

    @property
    def summary(self) -> str:
        """The docstring's line: what the wrong answer believes, or what of the hint it follows."""
        fn = self.function_node()
        return (ast.get_docstring(fn) or "").strip() if fn else ""

    def function_node(self) -> ast.FunctionDef | None:
        """The file's definition of the stub function, if it has one."""
        for node in ast.parse(self.path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == self.exercise.stub_name:
                return node
        return None


def load_mistakes(exercises_dir: Path = ep.EXERCISES_DIR, folder: str = MISTAKES_DIR) -> list[Answer]:
    """Every catalogued answer in ``<chapter>/<folder>/``, in exercise order; a file whose id names
    no exercise is an error."""
    exercises = {ex.id: ex for ex in ep.load_exercises(exercises_dir)}
    found = []
    for path in sorted(Path(exercises_dir).glob(f"*/{folder}/*.py")):
        ex_id = path.stem.split("_", 1)[0]
        ex = exercises.get(ex_id)
        if ex is None or ex.chapter != path.parent.parent.name:
            raise ValueError(f"{path}: its name must start with an exercise id of {path.parent.parent.name}")
        found.append(Answer(ex, path))
    order = list(exercises)
    return sorted(found, key=lambda m: (order.index(m.exercise.id), m.path.name))


def plant(stub_text: str, mistake: Answer, defined: set[str]) -> str:
    """``stub_text`` (a stub file) with ``mistake``'s function defined last, so it wins.

    The mistake's own imports of names the stub file defines are dropped: they would put the
    book's version of another exercise in place of what was planted for it.
    """
    source = mistake.path.read_text()
    kept = []
    for node in ast.parse(source).body:
        text = ast.get_source_segment(source, node) or ""
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            text = make_stubs._without(text, defined)
        if text:
            kept.append(text)
    return stub_text + f"\n\n# Planted: {mistake.name}\n" + "\n\n".join(kept) + "\n"


def rounds(mistakes: list[Answer]) -> list[list[Answer]]:
    """Round ``r`` holds the ``r``-th mistake of every exercise that has one."""
    per_exercise: dict[str, list[Answer]] = {}
    for m in mistakes:
        per_exercise.setdefault(m.exercise.id, []).append(m)
    depth = max((len(ms) for ms in per_exercise.values()), default=0)
    return [[ms[r] for ms in per_exercise.values() if r < len(ms)] for r in range(depth)]


def answer_key(chapters: list[str] | None = None) -> dict[Path, str]:
    """The answer key's stub files (relative path -> text)."""
    return make_stubs.expected_files(solutions=True, chapters=chapters)


def write_round(batch: list[Answer], key: dict[Path, str], workdir: Path) -> None:
    """Write the answer key into ``workdir`` with ``batch`` (at most one mistake per exercise)
    planted into it."""
    files = dict(key)
    all_exercises = ep.load_exercises()
    for m in batch:
        rel = Path(m.exercise.chapter) / m.exercise.stub_file
        defined = {
            ex.stub_name
            for ex in all_exercises
            if ex.chapter == m.exercise.chapter and ex.stub_file == m.exercise.stub_file
        }
        files[rel] = plant(files[rel], m, defined)
    make_stubs.write_files(files, workdir)


def grade_round(
    batch: list[Answer], key: dict[Path, str], workdir: Path, graded_by: str = "both", draw: str | None = None
) -> list[tuple[Answer, grade.ExerciseScore]]:
    """Plant ``batch`` (at most one mistake per exercise) into the answer key and grade them on
    their own tests (``graded_by``: both kinds, or only the hand-written or differential ones)."""
    write_round(batch, key, workdir)
    ids = [m.exercise.id for m in batch]
    scores = {s.id: s for s in grade.grade("student", exercises_dir=workdir, ids=ids, graded_by=graded_by, draw=draw)}
    return [(m, scores[m.exercise.id]) for m in batch]


def check(
    chapters: list[str] | None = None, graded_by: str = "both", draw: str | None = None, folder: str = MISTAKES_DIR
) -> list[tuple[Answer, grade.ExerciseScore]]:
    """Grade every catalogued answer of ``chapters`` (in ``folder``): a mistake must lose marks."""
    mistakes = [m for m in load_mistakes(folder=folder) if not chapters or m.exercise.chapter in chapters]
    key = answer_key(sorted({m.exercise.chapter for m in mistakes}))

    def graded(r: int, batch: list[Answer]) -> list[tuple[Answer, grade.ExerciseScore]]:
        with tempfile.TemporaryDirectory(prefix=f"mistakes-round{r}-") as tmp:
            return grade_round(batch, key, Path(tmp), graded_by, draw)

    # Each round is its own pytest process in its own folder, so rounds can run side by side: two
    # at a time, chapter 05's five rounds took 45 s instead of 74 on two cores, with the same marks.
    with ThreadPoolExecutor(max_workers=ROUNDS_AT_ONCE) as pool:
        futures = [pool.submit(graded, r, batch) for r, batch in enumerate(rounds(mistakes))]
        results = [result for future in futures for result in future.result()]
    return sorted(results, key=lambda result: mistakes.index(result[0]))


def caught_by(m: Answer, s: grade.ExerciseScore) -> dict[str, bool]:
    """Which kinds of the exercise's own tests fail with the mistake planted."""
    failed = [t.nodeid for t in s.tests if t.outcome != "passed"]
    return {
        "differential": any(m.exercise.selects(n, "differential") for n in failed),
        "hand-written": any(m.exercise.selects(n, "handwritten") for n in failed),
    }


def _figure(name: str, caught: int, total: int) -> str:
    return f"{name}: {caught}/{total} caught ({100 * caught / total:.1f} %)" if total else f"{name}: no mistakes"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapter", action="append", help="only this chapter (repeatable)")
    parser.add_argument(
        "--compare-draws",
        action="store_true",
        help="also grade the differential tests alone with each other way of drawing inputs "
        f"({', '.join(ep.harness.DRAWS)}) and print their figures",
    )
    args = parser.parse_args(argv)
    draw = ep.harness.draw_from(None)
    results = check(args.chapter)
    missed = 0
    counts = {"differential": 0, "hand-written": 0}
    for m, s in results:
        caught = s.total > 0 and s.passed < s.total
        missed += not caught
        kinds = caught_by(m, s)
        for kind, hit in kinds.items():
            counts[kind] += hit
        by = ", ".join(k for k, hit in kinds.items() if hit) or "nothing"
        verdict = f"caught {s.passed}/{s.total}" if caught else f"MISSED {s.passed}/{s.total}"
        print(f"{verdict:<14} by {by:<28} {m.name}: {m.summary}")
    total = len(results)
    print()
    print(_figure(f"differential tests alone ({draw} draws)", counts["differential"], total))
    print(_figure("hand-written tests alone", counts["hand-written"], total))
    print(_figure("all of an exercise's own tests", total - missed, total))
    if args.compare_draws:
        first = {m.path: caught_by(m, s)["differential"] for m, s in results}
        for other in (d for d in ep.harness.DRAWS if d != draw):
            alone = check(args.chapter, graded_by="differential", draw=other)
            hits = sum(s.total > 0 and s.passed < s.total for _, s in alone)
            print(_figure(f"differential tests alone ({other} draws)", hits, len(alone)))
            for m, s in alone:
                if (s.passed < s.total) != first[m.path]:
                    print(f"  {'only' if s.passed < s.total else 'not'} with {other} draws: {m.name}")
    print(f"\n{missed} mistake(s) scored full marks")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
