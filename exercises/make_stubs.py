"""Write the starter stub of every exercise in the registries, from the reference's own source.

Each stub keeps the reference's ``def`` line exactly (names, defaults, annotations) and its
docstring, plus the registry's hint, and raises ``NotImplementedError("Exercise 01.1: implement
BlockManager.allocate_slots — see 01_paged_kv/README.md#exercises")``. One stub file per
reference module, beside the chapter's ``exercises.toml``, importing what the reference module
imports so the signature's defaults and any helper the hint names are at hand.

Existing stub files are never overwritten (they hold students' work) unless ``--force``;
``--check`` exits non-zero if a stub file is missing or would differ from a fresh one.

    python exercises/make_stubs.py            # write the missing stub files
    python exercises/make_stubs.py --check    # what tests/test_exercises.py also checks
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import exercise_plugin as ep
import tomllib


def readme_anchor(ex: ep.Exercise) -> str:
    """The Exercises section that lists ``ex``: its chapter README's, or that of the page its
    registry entry names in an optional ``readme`` key (a chapter's topic page)."""
    with open(ep.EXERCISES_DIR / ex.chapter / ep.REGISTRY_NAME, "rb") as f:
        entries = tomllib.load(f).get("exercise", [])
    readme = next((e.get("readme") for e in entries if e["id"] == ex.id), None)
    return f"{readme or f'{ex.chapter}/README.md'}#exercises"


def stub_error(ex: ep.Exercise) -> str:
    return f"{ex.message} — see {readme_anchor(ex)}"


def _module_imports(module_name: str) -> list[str]:
    """The reference module's top-level import statements (no __future__), as written."""
    mod = importlib.import_module(module_name)
    source = inspect.getsource(mod)
    lines = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
            lines.append(ast.get_source_segment(source, node))
    return lines


def _used(import_line: str, funcs: list[str]) -> bool:
    """Does a stub use a name this import binds (in a signature, default or hint)?"""
    node = ast.parse(import_line).body[0]
    names = [(a.asname or a.name).split(".")[0] for a in node.names]
    return any(re.search(rf"\b{re.escape(n)}\b", f) for n in names for f in funcs)


def _own_names(modules: list[str], funcs: list[str]) -> list[str]:
    """Imports of the classes and aliases a stub names that its reference module defines."""
    lines = []
    for m in modules:
        mod = sys.modules[m]
        names = [
            n
            for n, v in vars(mod).items()
            if not n.startswith("_")
            and getattr(v, "__module__", m) == m
            and not inspect.ismodule(v)
            and (inspect.isclass(v) or isinstance(v, type) or n[0].isupper())
            and any(re.search(rf"\b{n}\b", f.split('"""')[0]) for f in funcs)
        ]
        if names:
            lines.append(f"from {m} import {', '.join(sorted(names))}")
    return lines


def _header_and_doc(ex: ep.Exercise) -> tuple[str, str | None]:
    """The reference's ``def`` line(s) verbatim, and its docstring."""
    fn = ep.reference_function(ex)
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    lines = source.splitlines()
    start = node.lineno - 1  # the def line itself: decorators are not part of the exercise
    end = node.body[0].lineno - 1
    header = "\n".join(lines[start:end]).rstrip()
    return header, ast.get_docstring(node, clean=True)


def stub_source(ex: ep.Exercise, hint: str) -> str:
    """The text of one stub function: the reference's header, a docstring, the raise."""
    header, doc = _header_and_doc(ex)
    name = header.split("def ", 1)[1].split("(", 1)[0]
    header = header.replace(f"def {name}(", f"def {ex.stub_name}(", 1)
    mine = []
    owner = ex.qualname.rsplit(".", 1)[0] if "." in ex.qualname else None
    if owner:
        mine.append(
            f"Becomes ``{ex.qualname}`` (a method: ``self`` is the {owner}). "
            f"Call parent methods as ``Parent.method(self, ...)``, not ``super()``."
        )
    if hint:
        mine.append("Hint: " + " ".join(hint.split()))
    mine.append(f"Checked by: pytest {ex.chapter}/ --impl=student --exercise {ex.id}")
    wrapped = [textwrap.fill(p, 92, break_long_words=False, break_on_hyphens=False) for p in mine]
    doc_text = "\n\n".join([doc or ex.title] + wrapped)
    body = textwrap.indent(f'"""{doc_text}\n"""\nraise NotImplementedError("{stub_error(ex)}")', "    ")
    return f"{header}\n{body}\n"


def solution_source(ex: ep.Exercise) -> tuple[str, set[str]]:
    """The reference function itself under the stub's name, and the module globals it reads.

    A teacher's answer key: ``--solutions DIR`` writes these, and ``pytest --impl=student
    --exercises-dir DIR`` must then pass, which checks the mechanism end to end.
    """
    fn = ep.reference_function(ex)
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    source = "\n".join(source.splitlines()[node.lineno - 1 :]) + "\n"
    source = source.replace(f"def {fn.__name__}(", f"def {ex.stub_name}(", 1)
    if "." in ex.qualname:  # zero-argument super() needs the class body it was written in
        owner = ex.qualname.rsplit(".", 1)[0].split(".")[-1]
        source = source.replace("super()", f"super({owner}, self)")
        globals_read = {owner}
    else:
        globals_read = set()
    module = sys.modules[fn.__module__]
    names = set(fn.__code__.co_names)
    for const in fn.__code__.co_consts:  # names read inside comprehensions and nested functions
        if inspect.iscode(const):
            names |= set(const.co_names)
    globals_read |= {n for n in names if n in vars(module) and not inspect.ismodule(vars(module)[n])}
    return source, globals_read


def file_source(
    chapter: str,
    stub_file: str,
    exercises: list[ep.Exercise],
    hints: dict[str, str],
    extra_imports: dict[str, list[str]],
    solutions: bool = False,
) -> str:
    modules = list(dict.fromkeys(ex.module_name for ex in exercises))
    ids = ", ".join(ex.id for ex in exercises)
    plural = "s" if len(exercises) > 1 else ""
    files = ", ".join(m.replace(".", "/") + ".py" for m in modules)
    head = [
        f'"""Exercise{plural} {ids} of {chapter}: your versions of {files}.',
        "",
        "Replace each `raise NotImplementedError(...)` with your code, then run",
        f"`pytest {chapter}/ --impl=student` (or `--exercise ID` for one exercise). The tests are",
        "the chapter's own; see exercises/README.md for how your function is put in place.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
    ]
    if solutions:
        funcs, imports = [], []
        for ex in exercises:
            text, names = solution_source(ex)
            funcs.append(text)
            imports += [f"from {ex.module_name} import {n}" for n in sorted(names)]
        imports += [line for m in modules for line in _module_imports(m) if _used(line, funcs)]
    else:
        funcs = [stub_source(ex, hints.get(ex.id, "")) for ex in exercises]
        imports = [line for m in modules for line in _module_imports(m) if _used(line, funcs)]
        imports += _own_names(modules, funcs)
    for ex in exercises:
        imports += extra_imports.get(ex.id, [])
    defined = {ex.stub_name for ex in exercises}
    head += [line for line in dict.fromkeys(_without(imp, defined) for imp in imports) if line]
    return ruff_clean("\n".join(head) + "\n\n\n" + "\n\n".join(funcs), Path(chapter) / stub_file)


def _without(import_line: str, names: set[str]) -> str:
    """``import_line`` minus the names this stub file defines itself (its definitions would
    shadow them); empty if nothing is left."""
    node = ast.parse(import_line).body[0]
    if not isinstance(node, ast.ImportFrom) or not any(a.name in names for a in node.names):
        return import_line
    kept = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names if (a.asname or a.name) not in names]
    return f"from {node.module} import {', '.join(kept)}" if kept else ""


def ruff_clean(text: str, rel: Path) -> str:
    """``text`` with its imports sorted and formatted as ``ruff`` (pyproject.toml) wants, so a
    stub passes the repository's lint and format checks as written."""
    filename = str(ep.EXERCISES_DIR / rel)
    for cmd in (["check", "--fix", "--select", "I", "--quiet", "--exit-zero"], ["format", "--quiet"]):
        text = subprocess.run(
            [sys.executable, "-m", "ruff", *cmd, "--stdin-filename", filename, "-"],
            input=text,
            capture_output=True,
            text=True,
            check=True,
            cwd=ep.ROOT,
        ).stdout
    return text


def registry_extras(chapter_dir: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    with open(chapter_dir / ep.REGISTRY_NAME, "rb") as f:
        data = tomllib.load(f)
    hints = {e["id"]: e.get("hint", "") for e in data.get("exercise", [])}
    imports = {e["id"]: e.get("imports", []) for e in data.get("exercise", [])}
    return hints, imports


def write_files(files: dict[Path, str], folder: Path) -> Path:
    """Write ``files`` (paths relative to ``folder``, as :func:`expected_files` gives them) into
    ``folder``, creating the folders they need; returns ``folder``."""
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


def expected_files(
    exercises_dir: Path = ep.EXERCISES_DIR,
    solutions: bool = False,
    chapters: list[str] | None = None,
    unimportable: list[str] | None = None,
) -> dict[Path, str]:
    """Every stub file the registries ask for, with its fresh text (or the answer key's).

    Chapters whose reference modules cannot be imported are skipped and added to
    ``unimportable``.
    """
    unimportable = [] if unimportable is None else unimportable
    out = {}
    exercises = ep.load_exercises(exercises_dir)
    for chapter in dict.fromkeys(ex.chapter for ex in exercises):
        if chapters and chapter not in chapters:
            continue
        hints, imports = registry_extras(exercises_dir / chapter)
        mine = [ex for ex in exercises if ex.chapter == chapter]
        for stub_file in dict.fromkeys(ex.stub_file for ex in mine):
            group = [ex for ex in mine if ex.stub_file == stub_file]
            try:
                out[Path(chapter) / stub_file] = file_source(chapter, stub_file, group, hints, imports, solutions)
            except ImportError as exc:  # a chapter still being written: say so, do the others
                print(f"skipped {chapter}/{stub_file}: cannot import its reference ({exc})", file=sys.stderr)
                unimportable.append(chapter)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report missing or stale stubs")
    parser.add_argument("--force", action="store_true", help="overwrite existing stub files")
    parser.add_argument(
        "--solutions",
        metavar="DIR",
        type=Path,
        help="write the answer key (the reference code as stubs) into DIR instead; "
        "then: pytest CHAPTER/ --impl=student --exercises-dir DIR",
    )
    parser.add_argument("--chapter", action="append", help="only this chapter (repeatable)")
    args = parser.parse_args(argv)
    unimportable: list[str] = []
    if args.solutions:
        write_files(expected_files(solutions=True, chapters=args.chapter, unimportable=unimportable), args.solutions)
        print(f"wrote the answer key to {args.solutions}")
        return 1 if unimportable else 0
    stale = []
    for rel, text in expected_files(chapters=args.chapter, unimportable=unimportable).items():
        path = ep.EXERCISES_DIR / rel
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
        elif current is None or args.force:
            path.write_text(text)
            print(f"wrote {path.relative_to(ep.ROOT)}")
        else:
            print(f"kept {path.relative_to(ep.ROOT)} (differs from a fresh stub; --force to overwrite)")
    for path in stale:
        print(f"stale or missing: {path.relative_to(ep.ROOT)}")
    return 1 if stale or unimportable else 0


if __name__ == "__main__":
    sys.exit(main())
