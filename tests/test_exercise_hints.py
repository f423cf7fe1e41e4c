"""Hints followed to the letter get full marks (exercises/<chapter>/hints/, exercises/hints.py).

Fast checks: each literal-hint answer is the stub function (its name, the reference's parameters)
with a one-line docstring saying what of the hint it follows, and every exercise whose hint states
a formula or a range has one. Slow check (one pytest subprocess per round): each, planted into the
answer key, keeps full marks on all of its exercise's own tests.
"""

import pytest
from exercise_scripts import check_answer_file, load_script

ep = load_script("exercise_plugin")
load_script("make_stubs")
load_script("trace_calls")  # before grade, which imports it
load_script("grade")
mistakes = load_script("mistakes")
hints = load_script("hints")

HINTED = mistakes.load_mistakes(folder=hints.HINTS_DIR)
# The exercises whose hints state a formula, a range or an order a learner can follow to the letter.
STATES_A_FORMULA = {
    "01.3", "01.4", "02.3", "03.1", "04.1", "05.1", "06.1", "06.4", "07.4", "07.9", "07.10", "07.S4", "07.T2a",
}  # fmt: skip


@pytest.mark.parametrize("ex_id", sorted(STATES_A_FORMULA))
def test_every_formula_hint_is_followed_by_an_answer(ex_id):
    ex = next(e for e in ep.load_exercises() if e.id == ex_id)
    assert any(a.exercise == ex for a in HINTED), (
        f"exercise {ex_id}'s hint states a formula: add exercises/{ex.chapter}/{hints.HINTS_DIR}/{ex_id}_<slug>.py, "
        f"a {ex.stub_name} written from the hint's words alone"
    )


@pytest.mark.parametrize("answer", HINTED, ids=lambda a: a.path.stem)
def test_hint_answer_is_the_stub_function(answer):
    check_answer_file(answer, "says what it follows")


@pytest.mark.slow
def test_every_hint_followed_to_the_letter_gets_full_marks():
    misled = [
        f"{a.name} scores {s.passed}/{s.total}: "
        + "; ".join(f"{t.nodeid}: {t.message[-300:]}" for t in s.tests if t.outcome != "passed")
        for a, s in hints.check()
        if s.total == 0 or s.passed < s.total
    ]
    assert not misled, "these hints, followed to the letter, lose marks:\n" + "\n".join(misled)
