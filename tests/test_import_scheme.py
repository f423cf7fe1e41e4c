"""The book's import scheme: every chapter directory is on sys.path and module names are unique.

Chapter directories start with digits, so they cannot be packages. The editable install puts
each of them on sys.path (hatchling's ``dev-mode-dirs``); a module is then imported by its
book-wide unique name from anywhere: tests, demos, later chapters and the engine.
"""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p for p in ROOT.iterdir() if p.is_dir() and p.name[:2].isdigit() and p.name[2] == "_")
# The engine chapter keeps its tests and its benchmark scripts in folders of their own, out of the
# reader's way; both are on sys.path like a chapter, so their helpers import by name too.
ENGINE_FOLDERS = [ROOT / "07_engine" / "benchmarks", ROOT / "07_engine" / "tests"]
SCRIPT_NAMES = {"demo.py", "conftest.py"}


def chapter_modules():
    """Importable chapter modules: every .py file directly in a chapter folder but tests/scripts."""
    mods = []
    for chapter in CHAPTERS:
        for f in sorted(chapter.glob("*.py")):
            if f.name in SCRIPT_NAMES or f.name.startswith(("test_", "bench")):
                continue
            mods.append(f)
    return mods


def test_layout_has_the_seven_chapters():
    names = [c.name for c in CHAPTERS]
    assert names == [
        "01_paged_kv",
        "02_page_attention",
        "03_prefix_cache",
        "04_scheduler",
        "05_spec_decode",
        "06_chunked_prefill",
        "07_engine",
    ]


def test_every_chapter_directory_is_on_sys_path():
    on_path = {Path(p).resolve() for p in sys.path if p}
    missing = [str(c.relative_to(ROOT)) for c in CHAPTERS + ENGINE_FOLDERS if c.resolve() not in on_path]
    assert not missing, f"not on sys.path (run ./setup.sh, which installs the repo editable): {missing}"


def test_module_and_test_file_names_are_unique_across_the_book():
    seen: dict[str, Path] = {}
    for chapter in CHAPTERS + ENGINE_FOLDERS + [ROOT / "tests"]:
        for f in chapter.glob("*.py"):
            if f.name in SCRIPT_NAMES:
                continue
            assert f.name not in seen, f"{f} and {seen[f.name]} share a name: one would shadow the other"
            seen[f.name] = f


def test_each_chapter_module_loads_once_from_its_own_file():
    for f in chapter_modules():
        mod = importlib.import_module(f.stem)
        assert Path(mod.__file__).resolve() == f.resolve(), f"{f.stem} resolved to {mod.__file__}"
    files = [Path(m.__file__).resolve() for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
    chapter_files = [p for p in files if any(c in p.parents for c in CHAPTERS)]
    assert len(chapter_files) == len(set(chapter_files)), "a chapter file is loaded under two module names"


def test_a_later_chapter_shares_classes_with_an_earlier_one():
    from block_manager import BlockManager
    from sequence import Sequence

    later = importlib.import_module("sequence")
    assert later.Sequence is Sequence
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = Sequence([1, 2, 3], block_size=2)
    bm.allocate(seq)
    assert isinstance(seq, later.Sequence) and len(seq.block_table) == 2


def test_imports_work_from_any_working_directory(tmp_path):
    code = "import block_manager, vllm_from_scratch; print(block_manager.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).resolve() == (ROOT / "01_paged_kv" / "block_manager.py").resolve()


@pytest.mark.parametrize("chapter", [c.name for c in CHAPTERS])
def test_every_chapter_has_readme_demo_and_tests(chapter):
    d = ROOT / chapter
    assert (d / "README.md").is_file(), f"{chapter} has no README.md"
    assert (d / "demo.py").is_file(), f"{chapter} has no demo.py"
    assert list(d.glob("test_*.py")) or list(d.glob("tests/test_*.py")), f"{chapter} has no tests"


PACKAGE = ROOT / "07_engine" / "vllm_from_scratch"


def _module_name(path: Path) -> str:
    """The dotted name of a file of the engine package (a package's ``__init__`` is the package)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """Every module of ``known`` that ``path`` imports anywhere: at the top, inside functions,
    under ``if TYPE_CHECKING:`` (mypy follows those, and a circle there is a circle to a reader)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from package import module` names a module; `from module import name` does not.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def test_the_book_has_no_import_cycle():
    """Chapter modules (by their book-wide names) and the engine package's modules, every import
    walked: a later module may import an earlier one, never the other way round."""
    files = {f.stem: f for f in chapter_modules()}
    files.update({_module_name(f): f for f in PACKAGE.rglob("*.py")})
    graph = {name: _imported_modules(f, set(files)) - {name} for name, f in files.items()}
    assert "vllm_from_scratch.engine" in graph and "scheduler" in graph["vllm_from_scratch.engine"]
    # Depth-first search; a module met again while it is still open closes a circle.
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                circle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
