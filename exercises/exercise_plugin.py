"""Classroom exercises: run a chapter's own tests against a student's code instead of the book's.

Each chapter has a registry, ``exercises/<chapter>/exercises.toml``, listing its exercises::

    [[exercise]]
    id = "01.1"                                          # chapter.number, as in the README
    title = "Grow a block table by whole blocks, attaching prefix hits first"
    target = "block_manager:BlockManager.allocate_slots" # module:qualified name of the reference
    stub = "block_manager_exercises.py:allocate_slots"   # file (beside the registry):function
    tests = ["01_paged_kv/test_block_manager.py::test_token_level_allocate_slots_grows_chunk_by_chunk"]

``title`` is the exercise's one line in the exercise list. A test grades at most one exercise.
The stub files ship with the book, each function raising ``NotImplementedError("Exercise 01.1:
implement BlockManager.allocate_slots — see 01_paged_kv/README.md#exercises")``. Students edit
the stubs, never the tests. With ``--impl=student`` (or ``VLLM_FS_IMPL=student``) every test runs
with the student's version of the exercises that list it put in place of the reference: the class
attribute is swapped, and a module-level function is swapped in every book module that imported
it (``from store_kvcache import store_kvcache`` binds a name at import time). Only those
exercises are swapped, so an unfinished exercise never fails another exercise's tests; in the
stub files, a sibling exercise's name then stands for the book's version. A test
that no exercise lists runs with every exercise of its chapter swapped: the chapter's whole
student version (the demo test, for example). Everything is put back after each test.

``--exercise 01.1`` (repeatable, or ``VLLM_FS_EXERCISE=01.1,01.3``) runs only that exercise's
tests. ``--exercises-dir DIR`` (or ``VLLM_FS_EXERCISES_DIR``) reads the stubs from a copy of
``exercises/``, e.g. one student's submission, so a grader never touches the working tree.

The root ``conftest.py`` forwards pytest's hooks here; this file is loaded by path (the
``exercises`` folder is not on ``sys.path``), under the module name ``vfs_exercise_plugin``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

EXERCISES_DIR = Path(__file__).resolve().parent
ROOT = EXERCISES_DIR.parent
REGISTRY_NAME = "exercises.toml"
IMPLS = ("reference", "student")


@dataclass(frozen=True)
class Exercise:
    """One exercise of one chapter, as its registry entry describes it."""

    id: str
    chapter: str
    title: str
    target: str
    stub: str
    tests: tuple[str, ...]

    @property
    def module_name(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":")[1]

    @property
    def stub_file(self) -> str:
        return self.stub.split(":")[0]

    @property
    def stub_name(self) -> str:
        return self.stub.split(":")[1]

    @property
    def message(self) -> str:
        """The text an untouched stub raises (tests check it starts every stub's error)."""
        return f"Exercise {self.id}: implement {self.qualname}"

    def selects(self, nodeid: str) -> bool:
        """Is the pytest item ``nodeid`` one of this exercise's tests (parametrized ids included)?"""
        return any(nodeid == t or nodeid.startswith((t + "[", t + "::")) for t in self.tests)


def load_exercises(exercises_dir: Path = EXERCISES_DIR) -> list[Exercise]:
    """Every exercise of every chapter registry under ``exercises_dir``, in chapter order."""
    found = []
    for registry in sorted(Path(exercises_dir).glob(f"*/{REGISTRY_NAME}")):
        chapter = registry.parent.name
        with open(registry, "rb") as f:
            data = tomllib.load(f)
        for entry in data.get("exercise", []):
            missing = {"id", "title", "target", "stub", "tests"} - entry.keys()
            if missing:
                raise ValueError(f"{registry}: exercise {entry.get('id', '?')} lacks {sorted(missing)}")
            if ":" not in entry["target"] or ":" not in entry["stub"]:
                raise ValueError(f"{registry}: exercise {entry['id']}: target and stub are 'file:name'")
            found.append(
                Exercise(entry["id"], chapter, entry["title"], entry["target"], entry["stub"], tuple(entry["tests"]))
            )
    owner: dict[str, str] = {}
    for e in found:  # one test grades one exercise, so every exercise's score is its own
        for t in e.tests:
            if t in owner:
                raise ValueError(f"test {t} is listed by exercises {owner[t]} and {e.id}")
            owner[t] = e.id
    ids = [e.id for e in found]
    if len(ids) != len(set(ids)):
        raise ValueError(f"exercise ids are not unique: {sorted(i for i in ids if ids.count(i) > 1)}")
    return found


def resolve_target(ex: Exercise) -> tuple[object, str]:
    """The object that holds the reference (a module or a class) and the attribute's name."""
    owner: object = importlib.import_module(ex.module_name)
    *path, name = ex.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise AttributeError(f"exercise {ex.id}: {ex.target} does not exist")
    return owner, name


def reference_function(ex: Exercise):
    """The plain function behind the reference (unwrapping staticmethod/classmethod/property)."""
    owner, name = resolve_target(ex)
    raw = owner.__dict__[name] if name in vars(owner) else getattr(owner, name)
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    if isinstance(raw, property):
        return raw.fget
    return raw


def stub_module_name(ex: Exercise) -> str:
    """The private name a stub file is imported under: unique per chapter and file, so stub
    files never shadow book modules."""
    return f"vfs_student_{ex.chapter}_{Path(ex.stub_file).stem}"


def load_stub(ex: Exercise, exercises_dir: Path = EXERCISES_DIR):
    """The student's function for ``ex``, imported from its stub file by path."""
    path = Path(exercises_dir) / ex.chapter / ex.stub_file
    mod_name = stub_module_name(ex)
    mod = sys.modules.get(mod_name)
    if mod is None or Path(mod.__file__).resolve() != path.resolve():
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None:
            raise FileNotFoundError(f"exercise {ex.id}: no stub file {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    try:
        return getattr(mod, ex.stub_name)
    except AttributeError:
        raise AttributeError(f"exercise {ex.id}: {path} defines no {ex.stub_name}") from None


def signature_key(fn) -> list[tuple]:
    """What must agree between a stub and its reference: names, kinds and defaults (not hints)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _book_modules():
    """Modules loaded from the repository's own files (chapters, tests), not from the venv."""
    venv = ROOT / ".venv"
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if not f:
            continue
        p = Path(f).resolve()
        if ROOT in p.parents and venv not in p.parents:
            yield mod


class Swap:
    """Puts student functions in place of reference ones, and takes them out again."""

    def __init__(self):
        self._undo: list[tuple[object, str, object, bool]] = []

    def apply(self, ex: Exercise, stub, params: dict | None = None) -> None:
        """Swap ``ex``'s reference for ``stub``; ``params`` are a parametrized test's arguments."""
        owner, name = resolve_target(ex)
        if inspect.ismodule(owner):
            ref = getattr(owner, name)
            for mod in _book_modules():
                for key, value in list(vars(mod).items()):
                    if value is ref:
                        self._set(mod, key, stub)
            # `@pytest.mark.parametrize("store", [store_kvcache_torch, ...])` captured the
            # reference at collection time: swap it in the test's arguments too.
            for key, value in (params or {}).items():
                if value is ref:
                    self._set_item(params, key, stub)
            self._set(owner, name, stub)
        else:
            raw = owner.__dict__[name]
            wrap = type(raw) if isinstance(raw, (staticmethod, classmethod, property)) else None
            self._set(owner, name, wrap(stub) if wrap else stub)

    def set_attr(self, owner, name, value) -> None:
        """Set ``owner.name`` to ``value`` until :meth:`undo`."""
        self._set(owner, name, value)

    def _set(self, owner, name, value) -> None:
        had = name in vars(owner)
        self._undo.append((owner, name, vars(owner).get(name), had))
        setattr(owner, name, value)

    def _set_item(self, mapping: dict, key, value) -> None:
        self._undo.append((mapping, key, mapping[key], None))
        mapping[key] = value

    def undo(self) -> None:
        for owner, name, old, had in reversed(self._undo):
            if had is None:
                owner[name] = old
            elif had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._undo.clear()


def _unloadable(ex: Exercise, exc: Exception):
    """Stands in for a stub that cannot be imported: every call says why."""

    def broken(*args, **kwargs):
        raise ImportError(
            f"Exercise {ex.id}: cannot load your {ex.stub} from {ex.chapter}/: {type(exc).__name__}: {exc}"
        ) from exc

    return broken


# ---------------------------------------------------------------------------- pytest hooks
def pytest_addoption(parser):
    group = parser.getgroup("vfs-exercises", "classroom exercises (exercises/README.md)")
    group.addoption(
        "--impl",
        choices=IMPLS,
        default=None,
        help="run tests against the book's reference code or the student's stubs in "
        "exercises/ (default: $VLLM_FS_IMPL or 'reference')",
    )
    group.addoption(
        "--exercise",
        action="append",
        default=None,
        metavar="ID",
        help="run only the tests of exercise ID, e.g. 01.2 (repeatable; $VLLM_FS_EXERCISE)",
    )
    group.addoption(
        "--exercises-dir",
        default=None,
        metavar="DIR",
        help="read stubs from DIR, a copy of exercises/ (default: $VLLM_FS_EXERCISES_DIR or exercises/)",
    )
    group.addoption(
        "--skip-slow-unlisted",
        action="store_true",
        default=False,
        help="leave out the tests marked slow that no exercise lists (grade.py's quicker run)",
    )


class ExercisePlugin:
    """Registered by ``pytest_configure``; holds the chosen implementation for the session."""

    def __init__(self, impl: str, selected: list[str], exercises_dir: Path):
        self.impl = impl
        self.exercises_dir = exercises_dir
        self.exercises = load_exercises(EXERCISES_DIR)
        known = {e.id for e in self.exercises}
        unknown = sorted(set(selected) - known)
        if unknown:
            raise pytest.UsageError(f"--exercise: unknown exercise {unknown}; known: {sorted(known)}")
        self.selected = [e for e in self.exercises if e.id in selected]
        self._stubs: dict[str, object] = {}

    def stub(self, ex: Exercise):
        """The student's function for ``ex``, imported on first use: a chapter that is broken or
        still being written never stops another chapter's tests."""
        if ex.id not in self._stubs:
            try:
                self._stubs[ex.id] = load_stub(ex, self.exercises_dir)
            except Exception as exc:  # a missing file or a student's syntax error fails the test, not the run
                self._stubs[ex.id] = _unloadable(ex, exc)
        return self._stubs[ex.id]

    def exercises_for(self, nodeid: str) -> list[Exercise]:
        listed = [e for e in self.exercises if e.selects(nodeid)]
        if listed:
            return listed
        chapter = nodeid.split("/")[0]
        return [e for e in self.exercises if e.chapter == chapter]

    def pytest_report_header(self, config):
        where = self.exercises_dir if self.impl == "student" else "the chapters"
        only = f", only {[e.id for e in self.selected]}" if self.selected else ""
        return f"vfs exercises: {self.impl} implementation from {where}{only}"

    def pytest_collection_modifyitems(self, config, items):
        if config.getoption("--skip-slow-unlisted"):
            listed = [i for i in items if "slow" not in i.keywords or any(e.selects(i.nodeid) for e in self.exercises)]
            if len(listed) < len(items):
                config.hook.pytest_deselected(items=[i for i in items if i not in listed])
                items[:] = listed
        if not self.selected:
            return
        keep = [i for i in items if any(e.selects(i.nodeid) for e in self.selected)]
        drop = [i for i in items if i not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.impl != "student":
            yield
            return
        swap = Swap()
        try:
            callspec = getattr(item, "callspec", None)
            swapped = self.exercises_for(item.nodeid)
            for ex in swapped:
                swap.apply(ex, self.stub(ex), callspec.params if callspec else None)
            # A stub that calls a sibling exercise's function by name (02.2's decode calls
            # gather_kv, 07.7 calls apply_top_k_top_p) reads it from its own stub file: there,
            # during another exercise's tests, the name stands for the book's version.
            for ex in self.exercises:
                if ex not in swapped and any(ex.chapter == s.chapter and ex.stub_file == s.stub_file for s in swapped):
                    module = sys.modules.get(stub_module_name(ex))
                    if module is not None and hasattr(module, ex.stub_name):
                        swap.set_attr(module, ex.stub_name, reference_function(ex))
            yield
        finally:
            swap.undo()


def pytest_configure(config):
    impl = config.getoption("--impl") or os.environ.get("VLLM_FS_IMPL") or "reference"
    if impl not in IMPLS:
        raise pytest.UsageError(f"VLLM_FS_IMPL must be one of {IMPLS}, got {impl!r}")
    selected = config.getoption("--exercise") or [os.environ.get("VLLM_FS_EXERCISE", "")]
    selected = [s.strip() for arg in selected for s in arg.split(",") if s.strip()]
    exercises_dir = Path(
        config.getoption("--exercises-dir") or os.environ.get("VLLM_FS_EXERCISES_DIR") or EXERCISES_DIR
    )
    config.pluginmanager.register(ExercisePlugin(impl, selected, exercises_dir.resolve()), "vfs-exercises")
