"""Classroom exercises: run a chapter's own tests against a student's code instead of the book's.

Each chapter has a registry, ``exercises/<chapter>/exercises.toml``, listing its exercises::

    [[exercise]]
    id = "01.1"                                          # chapter.number, as in the README
    title = "Grow a block table by whole blocks, attaching prefix hits first"
    target = "block_manager:BlockManager.allocate_slots" # module:qualified name of the reference
    stub = "block_manager_exercises.py:allocate_slots"   # file (beside the registry):function
    tests = ["01_paged_kv/test_block_manager.py::test_token_level_allocate_slots_grows_chunk_by_chunk"]
    differential = ["01_paged_kv/test_paged_kv_differential.py::test_allocate_slots"]

``title`` is the exercise's one line in the exercise list. ``tests`` are its hand-written tests,
``differential`` its differential ones (drawn inputs, compared with the book's own function:
``differential.py``); together they are the exercise's *own* tests, and a test is the own test
of at most one exercise. The stub files ship with the book, each function raising
``NotImplementedError("Exercise 01.1: implement BlockManager.allocate_slots — see
01_paged_kv/README.md#exercises")``. Students edit the stubs, never the tests.

With ``--impl=student`` (or ``VLLM_FS_IMPL=student``) a test runs with the student's versions
put in place of the reference: the class attribute is swapped, and a module-level function is
swapped in every book module that imported it (``from store_kvcache import store_kvcache`` binds
a name at import time). Which exercises are swapped is ``--swap``:

* ``own`` (the default): an exercise's own tests swap that exercise alone, so an unfinished
  exercise never fails another exercise's tests; in the stub files, a sibling exercise's name
  then stands for the book's version. A test that is nobody's own runs with every exercise of
  its chapter swapped: the chapter's whole student version (the demo test, for example).
* ``all`` (what ``grade.py`` uses): every test runs with every exercise of its chapter swapped
  (those given with ``--exercise`` only, if any), and records which of them it called. A test
  that fails is run again with each exercise it called swapped alone, and charged to those it
  fails with (to all of them if it fails only with them together): a failing chapter test always
  costs the exercises whose code made it fail.

Fixtures wider than one test (module or session scope: a loaded model, an engine) are built with
the book's code: they outlive the swap of the test that happens to build them first.

``--exercise 01.1`` (repeatable, or ``VLLM_FS_EXERCISE=01.1,01.3``) runs only that exercise's own
tests (``--graded-by differential`` or ``handwritten``: only those of one kind). ``--exercises-dir
DIR`` (or ``VLLM_FS_EXERCISES_DIR``) reads the stubs from a copy of ``exercises/``, e.g. one
student's submission, so a grader never touches the working tree. ``--grade-report FILE`` writes
one JSON line per test: its outcome, the exercises it swapped and called, and its verdict for each
(with the book's code, ``--impl=reference``, the calls alone: trace_calls.py's map). ``--only-tests
FILE`` runs only the tests FILE names, one a line (grade.py's selection).

The root ``conftest.py`` forwards pytest's hooks here; this file is loaded by path (the
``exercises`` folder is not on ``sys.path``), under the module name ``vfs_exercise_plugin``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
from _pytest.runner import runtestprotocol

EXERCISES_DIR = Path(__file__).resolve().parent
ROOT = EXERCISES_DIR.parent
REGISTRY_NAME = "exercises.toml"
IMPLS = ("reference", "student")
SWAPS = ("own", "all")
GRADED_BY = ("both", "handwritten", "differential")


def _load_sibling(stem: str):
    """``exercises/<stem>.py``, loaded by path once (``exercises/`` is not on sys.path)."""
    name = f"vfs_exercise_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXERCISES_DIR / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


harness = _load_sibling("differential")


def grading_env() -> dict[str, str]:
    """The environment of the pytest runs grade.py and trace_calls.py start.

    A grading run shares its cores (other submissions, other jobs): OpenMP threads that spin while
    they wait for work take them from everyone. Waiting passively, chapter 07 graded in 49 s beside
    three busy processes on 2 cores, where spinning took 179 s.
    """
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def _names(nodeid: str, test: str) -> bool:
    """Is ``nodeid`` the test ``test`` names: itself, one of its parametrized cases, or a method of
    the class it names?"""
    return nodeid == test or nodeid.startswith((test + "[", test + "::"))


@dataclass(frozen=True)
class Exercise:
    """One exercise of one chapter, as its registry entry describes it."""

    id: str
    chapter: str
    title: str
    target: str
    stub: str
    tests: tuple[str, ...]
    differential: tuple[str, ...] = ()

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

    def own_tests(self, graded_by: str = "both") -> tuple[str, ...]:
        """Its hand-written tests, its differential tests, or both."""
        return {"both": self.tests + self.differential, "handwritten": self.tests, "differential": self.differential}[
            graded_by
        ]

    def selects(self, nodeid: str, graded_by: str = "both") -> bool:
        """Is the pytest item ``nodeid`` one of this exercise's own tests (parametrized ids included)?"""
        return any(_names(nodeid, t) for t in self.own_tests(graded_by))


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
                Exercise(
                    entry["id"],
                    chapter,
                    entry["title"],
                    entry["target"],
                    entry["stub"],
                    tuple(entry["tests"]),
                    tuple(entry.get("differential", ())),
                )
            )
    owner: dict[str, str] = {}
    for e in found:  # one test is the own test of one exercise, so every exercise's score is its own
        for t in e.own_tests():
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


def _plain(raw):
    """The function inside a staticmethod, classmethod or property."""
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    if isinstance(raw, property):
        return raw.fget
    return raw


def reference_function(ex: Exercise):
    """The plain function behind the reference (unwrapping staticmethod/classmethod/property)."""
    owner, name = resolve_target(ex)
    return _plain(owner.__dict__[name] if name in vars(owner) else getattr(owner, name))


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


# name -> (the module under that name when it was classified, whether it is a book module)
_IS_BOOK_MODULE: dict[str, tuple[object, bool]] = {}


def _book_modules():
    """Modules loaded from the repository's own files (chapters, tests), not from the venv.

    Whether a module is one is decided once per module object: resolving the path of each of the
    thousands of modules torch and transformers load, at every swap, cost a second per test, and
    even reading their ``__file__`` again at every swap cost a fifth of a grading run."""
    venv = ROOT / ".venv"
    for name, mod in list(sys.modules.items()):
        seen = _IS_BOOK_MODULE.get(name)
        if seen is not None and seen[0] is mod:
            known = seen[1]
        else:
            file = getattr(mod, "__file__", None)
            path = Path(file).resolve() if file else None
            known = path is not None and ROOT in path.parents and venv not in path.parents
            _IS_BOOK_MODULE[name] = (mod, known)
        if known:
            yield mod


class Swap:
    """Puts student functions in place of reference ones, and takes them out again.

    ``suspend()`` puts the book back for a while (a shared fixture being built) and ``resume()``
    redoes the swap. ``installed`` maps each function put in place to the book's function it
    replaced, and ``original(owner, name)`` is the book's raw attribute: the ``differential``
    fixture reads the book's versions there.
    """

    def __init__(self):
        self._changes: list[tuple[object, object, object, object, bool | None]] = []  # owner, key, new, old, had
        self.installed: dict[int, object] = {}
        self._originals: dict[tuple[int, str], object] = {}
        self.suspended = False

    def apply(self, ex: Exercise, stub, params: dict | None = None) -> None:
        """Swap ``ex``'s reference for ``stub``; ``params`` are a parametrized test's arguments."""
        owner, name = resolve_target(ex)
        if inspect.ismodule(owner):
            ref = getattr(owner, name)
            self.installed[id(stub)] = ref
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
            self.installed[id(stub)] = _plain(raw)
            self._originals[(id(owner), name)] = raw
            wrap = type(raw) if isinstance(raw, (staticmethod, classmethod, property)) else None
            self._set(owner, name, wrap(stub) if wrap else stub)

    def original(self, owner: object, name: str):
        """The book's raw attribute ``owner.name`` (a class's), if this swap replaced it."""
        return self._originals.get((id(owner), name))

    def set_attr(self, owner, name, value) -> None:
        """Set ``owner.name`` to ``value`` until :meth:`undo`."""
        self._set(owner, name, value)

    def _set(self, owner, name, value) -> None:
        had = name in vars(owner)
        self._changes.append((owner, name, value, vars(owner).get(name), had))
        setattr(owner, name, value)

    def _set_item(self, mapping: dict, key, value) -> None:
        self._changes.append((mapping, key, value, mapping[key], None))
        mapping[key] = value

    def _restore(self) -> None:
        for owner, name, _, old, had in reversed(self._changes):
            if had is None:
                owner[name] = old  # type: ignore[index]
            elif had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)

    def suspend(self) -> None:
        """Put the book's functions back until :meth:`resume`."""
        if not self.suspended:
            self._restore()
            self.suspended = True

    def resume(self) -> None:
        if self.suspended:
            for owner, name, new, _, had in self._changes:
                if had is None:
                    owner[name] = new  # type: ignore[index]
                else:
                    setattr(owner, name, new)
            self.suspended = False

    def undo(self) -> None:
        if not self.suspended:
            self._restore()
        self._changes.clear()
        self.installed.clear()
        self._originals.clear()
        self.suspended = False


def _unloadable(ex: Exercise, exc: Exception):
    """Stands in for a stub that cannot be imported: every call says why."""

    def broken(*args, **kwargs):
        raise ImportError(
            f"Exercise {ex.id}: cannot load your {ex.stub} from {ex.chapter}/: {type(exc).__name__}: {exc}"
        ) from exc

    return broken


def _recorded(ex: Exercise, fn, called: set[str]):
    """``fn`` noting in ``called`` that exercise ``ex``'s code ran."""

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        __tracebackhide__ = True  # a failure's traceback goes from the caller straight into fn
        called.add(ex.id)
        return fn(*args, **kwargs)

    return recorded


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
        help="run only the own tests of exercise ID, e.g. 01.2 (repeatable; $VLLM_FS_EXERCISE)",
    )
    group.addoption(
        "--graded-by",
        choices=GRADED_BY,
        default="both",
        help="with --exercise: its hand-written tests, its differential tests, or both (default)",
    )
    group.addoption(
        "--swap",
        choices=SWAPS,
        default="own",
        help="with --impl=student: swap only a test's own exercise ('own', the default), or every "
        "exercise of its chapter, charging failures to the ones that cause them ('all', grade.py's)",
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
        help="leave out the tests marked slow that are no exercise's own (grade.py's quicker run)",
    )
    group.addoption(
        "--only-tests",
        default=None,
        metavar="FILE",
        help="run only the tests FILE names, one node id (or a test's id, for all its cases) a line",
    )
    group.addoption(
        "--grade-report",
        default=None,
        metavar="FILE",
        help="write one JSON line per test: outcome, exercises swapped and called, verdict per exercise",
    )
    group.addoption(
        "--test-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --impl=student, fail a test run that takes longer (grade.py's guard against code that hangs)",
    )
    group.addoption(
        "--draw",
        choices=harness.DRAWS,
        default=None,
        help="how differential tests draw inputs: Hypothesis (shrinks) or seeded random.Random "
        f"(default: $VLLM_FS_DRAW or {harness.DEFAULT_DRAW!r})",
    )


@dataclass
class Run:
    """One run of a test: with which exercises swapped, how it went, what it called."""

    swapped: list[str]
    outcome: str  # "passed", "failed", "skipped"
    message: str
    called: set[str]
    duration: float


def _summarize(reports) -> tuple[str, str]:
    """The outcome of a test's setup, call and teardown reports, and its failure message."""
    for rep in reports:
        if rep.failed:
            return "failed", rep.longreprtext[-6000:]
    if any(rep.skipped for rep in reports):
        return "skipped", next(rep.longreprtext for rep in reports if rep.skipped)[-500:]
    return "passed", ""


class ExercisePlugin:
    """Registered by ``pytest_configure``; holds the chosen implementation for the session."""

    def __init__(
        self,
        impl: str,
        selected: list[str],
        exercises_dir: Path,
        swap: str = "own",
        graded_by: str = "both",
        report: Path | None = None,
        draw: str = harness.DEFAULT_DRAW,
        test_timeout: float | None = None,
    ):
        self.impl = impl
        self.exercises_dir = exercises_dir
        self.swap_policy = swap
        self.graded_by = graded_by
        self.draw = draw
        self.test_timeout = test_timeout if impl == "student" else None
        self.exercises = load_exercises(EXERCISES_DIR)
        known = {e.id for e in self.exercises}
        unknown = sorted(set(selected) - known)
        if unknown:
            raise pytest.UsageError(f"--exercise: unknown exercise {unknown}; known: {sorted(known)}")
        self.selected = [e for e in self.exercises if e.id in selected]
        self._stubs: dict[str, object] = {}
        self._swap: Swap | None = None
        self._report = open(report, "a") if report else None  # noqa: SIM115 (closed at session end)

    def stub(self, ex: Exercise):
        """The student's function for ``ex``, imported on first use: a chapter that is broken or
        still being written never stops another chapter's tests."""
        if ex.id not in self._stubs:
            try:
                self._stubs[ex.id] = load_stub(ex, self.exercises_dir)
            except Exception as exc:  # a missing file or a student's syntax error fails the test, not the run
                self._stubs[ex.id] = _unloadable(ex, exc)
        return self._stubs[ex.id]

    def owners(self, nodeid: str) -> list[Exercise]:
        """The exercises whose own test ``nodeid`` is."""
        return [e for e in self.exercises if e.selects(nodeid)]

    def exercises_for(self, nodeid: str) -> list[Exercise]:
        """The exercises swapped for the test ``nodeid`` (``--swap own``: its own exercise, or
        its whole chapter for a test that is nobody's own; ``--swap all``: its whole chapter)."""
        chapter = nodeid.split("/")[0]
        if self.swap_policy == "own":
            listed = self.owners(nodeid)
            if listed:
                return listed
        pool = self.selected or self.exercises
        return [e for e in pool if e.chapter == chapter]

    def pytest_report_header(self, config):
        where = self.exercises_dir if self.impl == "student" else "the chapters"
        only = f", only {[e.id for e in self.selected]}" if self.selected else ""
        return f"vfs exercises: {self.impl} implementation from {where}{only}"

    def pytest_collection_modifyitems(self, config, items):
        only = config.getoption("--only-tests")
        if only:
            wanted = tuple(line.strip() for line in Path(only).read_text().splitlines() if line.strip())
            chosen = [i for i in items if any(_names(i.nodeid, w) for w in wanted)]
            if len(chosen) < len(items):
                config.hook.pytest_deselected(items=[i for i in items if i not in chosen])
                items[:] = chosen
        if config.getoption("--skip-slow-unlisted"):
            listed = [i for i in items if "slow" not in i.keywords or self.owners(i.nodeid)]
            if len(listed) < len(items):
                config.hook.pytest_deselected(items=[i for i in items if i not in listed])
                items[:] = listed
        if not self.selected:
            return
        keep = [i for i in items if any(e.selects(i.nodeid, self.graded_by) for e in self.selected)]
        drop = [i for i in items if i not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    # ------------------------------------------------------------------ running a test
    def _install(self, item, swapped: list[Exercise], recorded: list[Exercise], called: set[str]) -> Swap:
        """Swap in the student's versions of ``swapped``; wrap those and the book's versions of
        ``recorded`` so that a call of either lands in ``called``."""
        swap = Swap()
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec else None
        for ex in recorded:
            fn = self.stub(ex) if ex in swapped else reference_function(ex)
            swap.apply(ex, _recorded(ex, fn, called), params)
        for ex in swapped:
            if ex not in recorded:
                swap.apply(ex, self.stub(ex), params)
        # A stub that calls a sibling exercise's function by name (02.2's decode calls
        # gather_kv, 07.7 calls apply_top_k_top_p) reads it from its own stub file: there,
        # while that sibling is not swapped, the name stands for the book's version.
        for ex in self.exercises:
            if ex not in swapped and any(ex.chapter == s.chapter and ex.stub_file == s.stub_file for s in swapped):
                module = sys.modules.get(stub_module_name(ex))
                if module is not None and hasattr(module, ex.stub_name):
                    swap.set_attr(module, ex.stub_name, reference_function(ex))
        return swap

    def _run(self, item, nextitem, swapped: list[Exercise], log: bool) -> Run:
        """One run of ``item`` with ``swapped`` in place, recording calls of its chapter's exercises."""
        chapter = item.nodeid.split("/")[0]
        recorded = [e for e in self.exercises if e.chapter == chapter] if self._report else []
        called: set[str] = set()
        start = time.perf_counter()
        self._swap = self._install(item, swapped, recorded, called)
        limit = self.test_timeout if hasattr(signal, "setitimer") else None
        if limit:
            # A student's code can leave a server waiting on an answer that never comes: the run
            # fails after ``limit`` seconds instead of holding up the whole grade.
            def expire(signum, frame):
                pytest.fail(f"ran past {limit:g} s with {[e.id for e in swapped]} in place", pytrace=False)

            previous = signal.signal(signal.SIGALRM, expire)
            signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            reports = runtestprotocol(item, log=log, nextitem=nextitem)
        finally:
            if limit:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self._swap.undo()
            self._swap = None
        outcome, message = _summarize(reports)
        return Run([e.id for e in swapped], outcome, message, called, time.perf_counter() - start)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.impl != "student" and self._report is None:
            return None  # the book as it is: nothing to swap or record
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        swapped = self.exercises_for(item.nodeid) if self.impl == "student" else []
        main = self._run(item, nextitem, swapped, log=True)
        verdicts: dict[str, dict] = {}
        if self.impl == "student" and self.swap_policy == "all" and main.outcome != "skipped":
            verdicts = self._blame(item, nextitem, main, swapped)
        elif self.impl == "student" and main.outcome != "skipped":
            verdicts = {e.id: {"outcome": main.outcome, "message": main.message} for e in self.owners(item.nodeid)}
        if self._report is not None:
            entry = {
                "nodeid": item.nodeid,
                "outcome": main.outcome,
                "message": main.message,
                "duration": round(main.duration, 3),
                "swapped": main.swapped,
                "called": sorted(main.called),
                "verdicts": verdicts,
            }
            self._report.write(json.dumps(entry) + "\n")
            self._report.flush()
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _blame(self, item, nextitem, main: Run, swapped: list[Exercise]) -> dict[str, dict]:
        """Each exercise's verdict on this test: how the test goes with that exercise alone in
        place, run again where the run with all of them does not settle it."""
        in_play = {e.id: e for e in swapped}
        own = [e.id for e in self.owners(item.nodeid) if e.id in in_play]
        verdicts: dict[str, dict] = {}
        if main.outcome == "passed":
            for ex_id in main.called:
                verdicts[ex_id] = {"outcome": "passed", "message": ""}
            todo = [x for x in own if x not in main.called]  # its own exercise, not reached: try it alone
        else:
            todo = list(dict.fromkeys([*own, *sorted(main.called)]))
            if not todo:  # nothing of the student's ran: does the book itself fail here?
                book = self._run(item, nextitem, [], log=False)
                if book.outcome != "passed":
                    return {}  # the book's own failure: reported as the test's outcome, charged to nobody
                todo = list(in_play)
        alone: dict[str, Run] = {}
        while todo:
            ex_id = todo.pop(0)
            run = self._run(item, nextitem, [in_play[ex_id]], log=False)
            alone[ex_id] = run
            # With the others' book versions in place the test may reach exercises it did not before.
            todo += [x for x in sorted(run.called) if x in in_play and x not in alone and x not in todo]
        if main.outcome != "passed" and alone and all(r.outcome == "passed" for r in alone.values()):
            together = sorted(main.called) or sorted(alone)
            names = ", ".join(together)
            for ex_id in together:
                verdicts[ex_id] = {
                    "outcome": "failed",
                    "message": f"fails only with your {names} together, passes with each alone:\n{main.message}",
                }
            return verdicts
        for ex_id, run in alone.items():
            if run.outcome != "skipped" and (ex_id in run.called or ex_id in own or run.outcome == "failed"):
                verdicts[ex_id] = {"outcome": run.outcome, "message": run.message}
        return verdicts

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        # A fixture wider than one test is shared by tests that swap different exercises (and
        # built again for the runs that find which exercise a failure comes from): it is built
        # from the book's code, whatever the test that happens to build it first swaps.
        swap = self._swap
        shared = swap is not None and fixturedef.scope != "function"
        if shared:
            swap.suspend()
        try:
            yield
        finally:
            if shared:
                swap.resume()

    @pytest.fixture
    def differential(self):
        """Compare a swapped exercise with the book's own version on drawn inputs (differential.py)."""
        swap = self._swap
        installed = swap.installed if swap is not None else {}
        return harness.Differential(
            (lambda owner, name: swap.original(owner, name)) if swap is not None else (lambda owner, name: None),
            installed,
            self.impl,
            self.draw,
        )

    def pytest_unconfigure(self, config):
        if self._report is not None:
            self._report.close()


def pytest_configure(config):
    impl = config.getoption("--impl") or os.environ.get("VLLM_FS_IMPL") or "reference"
    if impl not in IMPLS:
        raise pytest.UsageError(f"VLLM_FS_IMPL must be one of {IMPLS}, got {impl!r}")
    selected = config.getoption("--exercise") or [os.environ.get("VLLM_FS_EXERCISE", "")]
    selected = [s.strip() for arg in selected for s in arg.split(",") if s.strip()]
    exercises_dir = Path(
        config.getoption("--exercises-dir") or os.environ.get("VLLM_FS_EXERCISES_DIR") or EXERCISES_DIR
    )
    try:
        draw = harness.draw_from(config.getoption("--draw"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    report = config.getoption("--grade-report")
    config.pluginmanager.register(
        ExercisePlugin(
            impl,
            selected,
            exercises_dir.resolve(),
            swap=config.getoption("--swap"),
            graded_by=config.getoption("--graded-by"),
            report=Path(report) if report else None,
            draw=draw,
            test_timeout=config.getoption("--test-timeout"),
        ),
        "vfs-exercises",
    )
