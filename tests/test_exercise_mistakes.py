"""The catalogue of classic wrong answers (exercises/<chapter>/mistakes/) and the grader agree.

Fast checks: every exercise has at least one catalogued mistake, and each mistake is the stub
function (its name, the reference's parameters) with a one-line docstring naming the
misconception. Slow checks (one pytest subprocess per round): each mistake, planted into the
answer key, loses marks on its own exercise, with a failure that says so.
"""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from exercise_scripts import check_answer_file, load_script

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"


ep = load_script("exercise_plugin")
load_script("make_stubs")
load_script("trace_calls")  # before grade, which imports it
load_script("grade")
mistakes = load_script("mistakes")

ALL = ep.load_exercises()
MISTAKES = mistakes.load_mistakes()
CHAPTERS = sorted({ex.chapter for ex in ALL})


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: ex.id)
def test_every_exercise_has_a_catalogued_mistake(ex):
    assert any(m.exercise == ex for m in MISTAKES), (
        f"exercise {ex.id} has no wrong answer in exercises/{ex.chapter}/{mistakes.MISTAKES_DIR}/: "
        f"add {ex.id}_<slug>.py defining a wrong {ex.stub_name}"
    )


@pytest.mark.parametrize("m", MISTAKES, ids=lambda m: m.path.stem)
def test_mistake_is_the_stub_function_with_its_misconception(m):
    check_answer_file(m, "names the mistake")


@pytest.fixture(scope="module")
def graded_mistakes():
    """Every chapter's mistakes, graded by one ``mistakes.check()``.

    Its rounds take the r-th mistake of every exercise of every chapter: one pytest run per round
    for the whole catalogue instead of one per round per chapter, each mistake still graded alone
    in place on all of its exercise's own tests, as ``mistakes.check([chapter])`` grades it."""
    return mistakes.check()


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_mistake_loses_marks(chapter, request):
    if not any(m.exercise.chapter == chapter for m in MISTAKES):
        pytest.skip(f"{chapter} has no catalogued mistakes")
    missed = []
    graded = [(m, s) for m, s in request.getfixturevalue("graded_mistakes") if m.exercise.chapter == chapter]
    assert [m for m, _ in graded] == [m for m in MISTAKES if m.exercise.chapter == chapter]
    for m, s in graded:
        if s.total == 0:
            missed.append(f"{m.name}: none of exercise {m.exercise.id}'s tests ran")
        elif s.passed == s.total:
            missed.append(f"{m.name} scores {s.passed}/{s.total}: {m.summary}")
    assert not missed, "the tests do not catch these wrong answers:\n" + "\n".join(missed)


@pytest.mark.slow
def test_a_failing_chapter_test_costs_the_exercise_whose_code_fails_it(tmp_path):
    """A wrong 04.3 that never asks the KV connector fails chapter tests that are no exercise's
    own (the property tests): grade.py runs them with every exercise in place, charges each
    failure to the exercise it fails with alone, and 04.3's mark drops."""
    grade = sys.modules["grade"]
    (m,) = [m for m in MISTAKES if m.path.name == "04.3_no_kv_connector.py"]
    key = mistakes.answer_key(["04_scheduler"])
    mistakes.write_round([], key, tmp_path / "key")
    mistakes.write_round([m], key, tmp_path / "wrong")
    # The two gradings are independent pytest processes in their own folders: side by side, as
    # mistakes.check() runs its rounds.
    with ThreadPoolExecutor(max_workers=mistakes.ROUNDS_AT_ONCE) as pool:
        clean_run = pool.submit(
            grade.grade_all, exercises_dir=tmp_path / "key", chapters=["04_scheduler"], chapter_tests="all"
        )
        wrong_run = pool.submit(
            grade.grade_all, exercises_dir=tmp_path / "wrong", chapters=["04_scheduler"], chapter_tests="all"
        )
        clean_scores, (clean,) = clean_run.result()
        scores, (wrong,) = wrong_run.result()
    assert clean.passed > 0 and clean.failed == 0, [t.nodeid for t in clean.tests if t.outcome == "failed"]
    assert all(s.full and s.chapter_total > 0 for s in clean_scores), [(s.id, s.mark) for s in clean_scores]
    failed = [t for t in wrong.tests if t.outcome == "failed"]
    assert wrong.failed == len(failed) > 0
    assert all("test_scheduler_properties.py" in t.nodeid and "_start_remote_load" in t.message for t in failed), [
        (t.nodeid, t.message[:200]) for t in failed
    ]
    assert all(wrong.charged[t.nodeid] == ["04.3"] for t in failed), wrong.charged
    by_id = {s.id: s for s in scores}
    charged = {t.nodeid for t in by_id["04.3"].chapter_tests if t.outcome == "failed"}
    assert {t.nodeid for t in failed} <= charged and by_id["04.3"].mark < 1
    assert all(by_id[i].full for i in ("04.1", "04.2", "04.4")), [(s.id, s.mark) for s in scores]
