"""The classroom exercise mechanism (exercises/README.md) holds for every chapter.

Fast checks: every chapter with tests has at least three exercises; each names a reference that
exists, a stub with the reference's exact signature that raises its own NotImplementedError,
and tests that exist. Slow checks (one pytest subprocess each, over every chapter): the untouched
stubs fail every exercise test with that message, the reference passes them all, and an answer
key made from the reference passes them all through the student path.
"""

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ep = _load("vfs_exercise_plugin", EXERCISES / "exercise_plugin.py")
sys.modules.setdefault("exercise_plugin", ep)  # what grade.py and make_stubs.py import
grade = _load("vfs_exercise_grade", EXERCISES / "grade.py")
make_stubs = _load("vfs_exercise_make_stubs", EXERCISES / "make_stubs.py")

ALL = ep.load_exercises()
CHAPTERS_WITH_TESTS = sorted(p.parent.name for p in ROOT.glob("0*_*/test_*.py"))


@pytest.mark.parametrize("chapter", sorted(set(CHAPTERS_WITH_TESTS)))
def test_every_chapter_with_tests_has_three_exercises(chapter):
    mine = [ex for ex in ALL if ex.chapter == chapter]
    assert len(mine) >= 3, f"{chapter} has {len(mine)} exercises in exercises/{chapter}/exercises.toml"
    assert all(ex.id.startswith(chapter[:2] + ".") for ex in mine), [ex.id for ex in mine]


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: ex.id)
def test_stub_signature_equals_the_reference(ex):
    reference = ep.reference_function(ex)
    stub = ep.load_stub(ex)
    assert ep.signature_key(stub) == ep.signature_key(reference), (
        f"exercise {ex.id}: stub {ex.stub} has signature {inspect.signature(stub)}, "
        f"the reference {ex.target} has {inspect.signature(reference)}"
    )


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: ex.id)
def test_untouched_stub_raises_its_own_message(ex):
    stub = ep.load_stub(ex)
    args = [object()] * sum(
        p.default is p.empty and p.kind <= p.POSITIONAL_OR_KEYWORD for p in inspect.signature(stub).parameters.values()
    )
    with pytest.raises(
        NotImplementedError,
        match=rf"^Exercise {ex.id}: implement {ex.qualname} — see "
        rf"{re.escape(make_stubs.readme_anchor(ex))}$",  # the chapter README's, or its registry entry's page
    ):
        stub(*args)


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: ex.id)
def test_listed_tests_exist(ex):
    assert ex.tests, f"exercise {ex.id} lists no test"
    for nodeid in ex.tests:
        path, *names = nodeid.split("::")
        assert path.startswith(ex.chapter + "/"), f"{nodeid}: an exercise is graded by its chapter's tests"
        file = ROOT / path
        assert file.is_file(), f"exercise {ex.id}: no test file {path}"
        scope = ast.parse(file.read_text()).body
        for name in [n.split("[")[0] for n in names]:  # test_x[param] is an instance of test_x
            found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
            assert found, f"exercise {ex.id}: {path} defines no {name}"
            scope = found[0].body


def test_registry_rejects_a_test_graded_twice(tmp_path):
    chapter = tmp_path / "01_paged_kv"
    chapter.mkdir()
    entry = (
        '[[exercise]]\nid = "{id}"\ntitle = "t"\ntarget = "block_manager:cdiv"\n'
        'stub = "s.py:cdiv"\ntests = ["01_paged_kv/test_block_manager.py::test_x"]\n'
    )
    (chapter / "exercises.toml").write_text(entry.format(id="01.1") + entry.format(id="01.2"))
    with pytest.raises(ValueError, match="listed by exercises 01.1 and 01.2"):
        ep.load_exercises(tmp_path)


def test_swap_is_undone():
    from block_manager import BlockManager

    ex = next(e for e in ALL if e.target == "block_manager:BlockManager.slot_mapping")
    original = BlockManager.__dict__["slot_mapping"]
    swap = ep.Swap()
    swap.apply(ex, ep.load_stub(ex))
    assert BlockManager.__dict__["slot_mapping"] is not original
    swap.undo()
    assert BlockManager.__dict__["slot_mapping"] is original


@pytest.mark.slow
def test_untouched_stubs_fail_with_their_message():
    bad = []
    for s in grade.grade("student"):
        listed = next(ex for ex in ALL if ex.id == s.id).tests
        if s.total < len(listed):
            bad.append(f"{s.id}: only {s.total} of its {len(listed)} tests ran")
        for r in s.tests:
            if (
                r.outcome not in ("failed", "error")
                or f"NotImplementedError: Exercise {s.id}: implement" not in r.message
            ):
                bad.append(
                    f"{s.id}: {r.nodeid} {r.outcome} against the untouched stub, not with its "
                    f"message:\n{r.message[-1200:]}"
                )
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_reference_passes_every_exercise_test():
    bad = []
    for s in grade.grade("reference"):
        if s.total == 0:
            bad.append(f"exercise {s.id}: none of its tests ran")
        bad += [f"{r.nodeid}: {r.outcome}\n{r.message[-800:]}" for r in s.tests if r.outcome != "passed"]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_answer_key_passes_through_the_student_path(tmp_path):
    for rel, text in make_stubs.expected_files(solutions=True).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    bad = []
    for s in grade.grade("student", exercises_dir=tmp_path):
        if s.total == 0:
            bad.append(f"exercise {s.id}: none of its tests ran")
        bad += [f"{r.nodeid}: {r.outcome}\n{r.message[-800:]}" for r in s.tests if r.outcome != "passed"]
    assert not bad, "\n".join(bad)
