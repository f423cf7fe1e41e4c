"""The classroom exercise mechanism (exercises/README.md) holds for every chapter.

Fast checks: every chapter with tests has at least three exercises; each names a reference that
exists, a stub with the reference's exact signature that raises its own NotImplementedError,
and tests that exist. Slow checks (one pytest subprocess each, over every chapter, two at a time):
the untouched stubs fail every exercise test with that message, the reference passes them all,
and an answer key made from the reference passes them all through the student path.
"""

import ast
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
import types
import typing
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from exercise_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"


ep = load_script("exercise_plugin")
trace_calls = load_script("trace_calls")  # before grade, which imports it
grade = load_script("grade")
make_stubs = load_script("make_stubs")

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
    assert ex.tests, f"exercise {ex.id} lists no hand-written test"
    assert ex.differential, f"exercise {ex.id} lists no differential test (drawn inputs against the book's function)"
    for nodeid in ex.own_tests():
        path, *names = nodeid.split("::")
        assert path.startswith(ex.chapter + "/"), f"{nodeid}: an exercise is graded by its chapter's tests"
        file = ROOT / path
        assert file.is_file(), f"exercise {ex.id}: no test file {path}"
        scope = ast.parse(file.read_text()).body
        for name in [n.split("[")[0] for n in names]:  # test_x[param] is an instance of test_x
            found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
            assert found, f"exercise {ex.id}: {path} defines no {name}"
            scope = found[0].body


def test_chapter_test_maps_know_every_test():
    """grade.py picks the chapter tests it runs from trace_calls.py's maps: a test they do not know
    would never run in a grade, so a changed test file needs ``trace_calls.py --chapter`` again."""
    stale = trace_calls.stale(sorted({ex.chapter for ex in ALL}))
    advice = "exercises/<chapter>/chapter_tests.json is stale: run exercises/trace_calls.py --new-only"
    assert not stale, advice + "\n" + "\n".join(stale)


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


# Whole-book gradings side by side: each is one pytest process, mostly on one core.
GRADINGS_AT_ONCE = 2


@pytest.fixture(scope="module")
def whole_book_gradings(request, tmp_path_factory):
    """The whole-book gradings of the slow checks below, by the name of the test that reads each,
    started together in the background, two at a time: only those of the tests that will run."""
    wanted = {item.name for item in request.session.items if item.module is request.module}
    key = "test_answer_key_passes_through_the_student_path"
    key_dir = (
        make_stubs.write_files(make_stubs.expected_files(solutions=True), tmp_path_factory.mktemp("answer_key"))
        if key in wanted
        else None
    )
    runs = {
        "test_untouched_stubs_fail_with_their_message": lambda: grade.grade("student"),
        "test_reference_passes_every_exercise_test": lambda: grade.grade("reference"),
        key: lambda: grade.grade("student", exercises_dir=key_dir),
    }
    pool = ThreadPoolExecutor(max_workers=GRADINGS_AT_ONCE)
    futures: dict[str, Future] = {name: pool.submit(run) for name, run in runs.items() if name in wanted}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.slow
def test_untouched_stubs_fail_with_their_message(whole_book_gradings, request):
    bad = []
    for s in whole_book_gradings[request.node.name].result():
        listed = next(ex for ex in ALL if ex.id == s.id).own_tests()
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
def test_reference_passes_every_exercise_test(whole_book_gradings, request):
    bad = []
    for s in whole_book_gradings[request.node.name].result():
        if s.total == 0:
            bad.append(f"exercise {s.id}: none of its tests ran")
        bad += [f"{r.nodeid}: {r.outcome}\n{r.message[-800:]}" for r in s.tests if r.outcome != "passed"]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_answer_key_passes_through_the_student_path(whole_book_gradings, request):
    bad = []
    for s in whole_book_gradings[request.node.name].result():
        if s.total == 0:
            bad.append(f"exercise {s.id}: none of its tests ran")
        bad += [f"{r.nodeid}: {r.outcome}\n{r.message[-800:]}" for r in s.tests if r.outcome != "passed"]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- hints and docstrings tell the truth
def _hint(ex) -> str:
    return make_stubs.registry_extras(EXERCISES / ex.chapter)[0].get(ex.id, "")


def _instance_attributes(cls) -> set[str]:
    """Attributes an instance of ``cls`` gets: class attributes, dataclass fields and annotations,
    and every ``self.NAME`` assigned in the source of ``cls`` and its bases."""
    names = set(dir(cls))
    for klass in inspect.getmro(cls):
        names |= set(getattr(klass, "__annotations__", {}))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        tree = ast.parse(textwrap.dedent(source))
        names |= {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and ast.unparse(n.value) == "self"
        }
    return names


def _attribute_type(cls, name: str):
    """The class an instance attribute ``name`` of ``cls`` holds, if an annotation says so."""
    for klass in inspect.getmro(cls):
        for fn in (klass, getattr(klass, "__init__", None)):
            try:
                hints = typing.get_type_hints(fn)
            except Exception:  # an annotation that names what this module cannot import
                continue
            if name in hints:
                return hints[name]
    return None


def _classes(tp) -> list[type]:
    """The classes a type annotation allows (a union's members; Optional's non-None one)."""
    args = typing.get_args(tp)
    if args and (typing.get_origin(tp) in (typing.Union, types.UnionType)):
        return [c for a in args for c in _classes(a)]
    return [tp] if inspect.isclass(tp) and tp is not type(None) else []


def _resolves(root, path: list[str], on_class: bool) -> bool:
    """Does ``root.path[0].path[1]...`` exist? ``on_class``: ``root`` is a class whose instances
    are meant (instance attributes count). An attribute whose type is unknown ends the walk."""
    for i, part in enumerate(path):
        if on_class and inspect.isclass(root):
            if part not in _instance_attributes(root):
                return False
            if hasattr(root, part) and not isinstance(inspect.getattr_static(root, part), property):
                root, on_class = getattr(root, part), False
                continue
            kinds = _classes(_attribute_type(root, part))
            rest = path[i + 1 :]
            return not kinds or not rest or any(_resolves(k, rest, True) for k in kinds)
        if not hasattr(root, part):
            return False
        root = getattr(root, part)
    return True


DOTTED = re.compile(r"\b([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)")
BACKTICKED = re.compile(r"`+(?::\w+:`)?([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(?:\(\))?`+")


def _unresolved(ex, text: str, pattern: re.Pattern) -> list[str]:
    """Dotted names in ``text`` that do not exist: ``self.x`` on the target's class, ``seq.x`` on
    the type of the target's parameter ``seq``, ``Name.x`` in the stub file's or reference
    module's namespace or a module of that name."""
    owner, _ = ep.resolve_target(ex)
    ref = ep.reference_function(ex)
    params = typing.get_type_hints(ref) if ref.__annotations__ else {}
    namespace = {**vars(sys.modules[ref.__module__]), **vars(inspect.getmodule(ep.load_stub(ex)))}
    bad = []
    for root, rest in pattern.findall(text):
        path = rest.lstrip(".").split(".")
        if root == "self" and inspect.isclass(owner):
            ok = _resolves(owner, path, True)
        elif root in params:
            ok = any(_resolves(k, path, True) for k in _classes(params[root])) or not _classes(params[root])
        elif root in namespace:
            ok = _resolves(namespace[root], path, False)
        elif importlib.util.find_spec(root) is not None:  # a book module named in full
            ok = _resolves(importlib.import_module(root), path, False)
        else:
            ok = False
        if not ok:
            bad.append(f"{root}{rest}")
    return bad


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: ex.id)
def test_every_name_a_hint_or_docstring_gives_exists(ex):
    bad = _unresolved(ex, _hint(ex), DOTTED)
    bad += _unresolved(ex, inspect.getdoc(ep.reference_function(ex)) or "", BACKTICKED)
    assert not bad, f"exercise {ex.id}: its hint or docstring names what does not exist: {bad}"


def _expected_errors(ex) -> set[str]:
    """ValueError/TypeError that ``ex``'s tests expect from a call of the exercise's function."""
    name = ex.qualname.split(".")[-1]
    found = set()
    for nodeid in ex.tests:
        path, *names = nodeid.split("::")
        scope = ast.parse((ROOT / path).read_text()).body
        for n in [n.split("[")[0] for n in names]:
            scope = next(s for s in scope if isinstance(s, (ast.FunctionDef, ast.ClassDef)) and s.name == n).body
        for with_node in (w for s in scope for w in ast.walk(s) if isinstance(w, ast.With)):
            for item in with_node.items:
                call = item.context_expr
                if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.raises" and call.args):
                    continue
                error = ast.unparse(call.args[0])
                calls = {
                    ast.unparse(c.func).split(".")[-1]
                    for b in with_node.body
                    for c in ast.walk(b)
                    if isinstance(c, ast.Call)
                }
                if error in ("ValueError", "TypeError") and name in calls:
                    found.add(error)
    return found


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: ex.id)
def test_every_error_the_tests_expect_is_announced(ex):
    told = _hint(ex) + (inspect.getdoc(ep.reference_function(ex)) or "")
    missing = sorted(e for e in _expected_errors(ex) if e not in told)
    assert not missing, (
        f"exercise {ex.id}: its tests expect {missing} from {ex.qualname}, which neither its hint nor its "
        "docstring mentions"
    )


def _siblings_called(ex) -> list:
    """The exercises of ``ex``'s stub file whose function its reference calls by bare name (02.2's
    paged_attention_decode calls gather_kv): in a student's stub file that name is their stub."""
    source, _ = make_stubs.solution_source(ex)
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    return [
        s
        for s in ALL
        if s is not ex and (s.chapter, s.stub_file) == (ex.chapter, ex.stub_file) and s.stub_name in names
    ]


@pytest.mark.slow
def test_an_answer_passes_while_the_exercises_it_calls_are_unfinished(tmp_path):
    """exercises/README.md promises that an unfinished exercise never fails another's tests: an
    answer that calls a sibling exercise's function passes beside that sibling's untouched stub."""
    callers = [ex for ex in ALL if _siblings_called(ex)]
    assert {"02.2", "07.7"} <= {ex.id for ex in callers}
    key = make_stubs.expected_files(solutions=True, chapters=sorted({ex.chapter for ex in callers}))
    # One pytest run per round; a round answers at most one exercise per stub file.
    rounds: list[list] = []
    for ex in callers:
        free = [r for r in rounds if all((o.chapter, o.stub_file) != (ex.chapter, ex.stub_file) for o in r)]
        if free:
            free[0].append(ex)
        else:
            rounds.append([ex])
    bad = []
    for r, batch in enumerate(rounds):
        files = dict(key)
        for ex in batch:
            rel = Path(ex.chapter) / ex.stub_file
            hints = make_stubs.registry_extras(EXERCISES / ex.chapter)[0]
            stubs = [make_stubs.stub_source(s, hints.get(s.id, "")) for s in _siblings_called(ex)]
            files[rel] = files[rel] + "\n\n" + "\n\n".join(stubs)
        make_stubs.write_files(files, tmp_path / f"round{r}")
        by_id = {ex.id: ex for ex in batch}
        for s in grade.grade("student", exercises_dir=tmp_path / f"round{r}", ids=list(by_id)):
            if s.total == 0 or s.passed < s.total:
                unfinished = [x.id for x in _siblings_called(by_id[s.id])]
                failed = [f"{t.nodeid}: {t.message[-300:]}" for t in s.tests if t.outcome != "passed"]
                bad.append(f"{s.id} fails beside the unfinished {unfinished}: {failed}")
    assert not bad, "\n".join(bad)
