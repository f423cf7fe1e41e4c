"""The book's site builds with `mkdocs build --strict`, and the build hook publishes the chapters.

The strict build fails on any warning: a broken link, a page missing from the nav, a nav entry
without a page. The hook (docs/hooks/book_pages.py) is tested directly for its link rewriting.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _hook():
    spec = importlib.util.spec_from_file_location("vfs_book_pages_hook", ROOT / "docs" / "hooks" / "book_pages.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_links_are_rewritten_for_the_site():
    hook = _hook()
    pages = {
        "README.md": "getting-started.md",
        "01_paged_kv/README.md": "01_paged_kv/README.md",
        "04_scheduler/README.md": "04_scheduler/README.md",
    }
    assets = {}
    text = (
        "[bm](block_manager.py) [next](../04_scheduler/README.md#idea) [dir](../04_scheduler/) "
        "[gl](../docs/glossary.md#slot) [web](https://vllm.ai) [gone](missing.py)\n"
        "```\n[in code](block_manager.py)\n```\n"
    )
    out = hook.rewrite_links(text, "01_paged_kv/README.md", "01_paged_kv/README.md", pages, assets)
    assert "[bm](block_manager.py)" in out and assets == {
        "01_paged_kv/block_manager.py": "01_paged_kv/block_manager.py"
    }
    assert "[next](../04_scheduler/README.md#idea)" in out and "[dir](../04_scheduler/README.md)" in out
    assert "[gl](../glossary.md#slot)" in out and "[web](https://vllm.ai)" in out
    assert "[gone](missing.py)" in out  # left broken, so that --strict reports it
    assert "[in code](block_manager.py)" in out
    root = hook.rewrite_links(
        "[c1](01_paged_kv/README.md) [d](docs/teaching.md)", "README.md", "getting-started.md", pages, {}
    )
    assert root == "[c1](01_paged_kv/README.md) [d](teaching.md)"


def test_docs_pages_are_written_for_the_repository_and_rewritten_for_the_site():
    hook = _hook()
    pages = {"README.md": "getting-started.md", "01_paged_kv/README.md": "01_paged_kv/README.md"}
    assets = {}
    text = (
        "[c1](../01_paged_kv/README.md#slot-mapping) [start](../README.md) [g](glossary.md) "
        "[code](../01_paged_kv/block_manager.py) ![f](figures/kv_pool.png)\n"
    )
    out = hook.docs_page_for_site(text, "index.md", pages, assets)
    assert out == (
        "[c1](01_paged_kv/README.md#slot-mapping) [start](getting-started.md) [g](glossary.md) "
        "[code](01_paged_kv/block_manager.py) ![f](figures/kv_pool.png)\n"
    )
    assert assets == {"01_paged_kv/block_manager.py": "01_paged_kv/block_manager.py"}
    wrapped = hook.docs_page_for_site("[the paged\nKV cache](../01_paged_kv/README.md)\n", "index.md", pages, {})
    assert wrapped == "[the paged\nKV cache](01_paged_kv/README.md)\n"  # link text over two lines


def test_docs_links_resolve_in_the_repository():
    """A reader of the repository (GitHub, an editor) follows the docs pages' links as written.

    Generated sections are left out: their links come from the chapter pages, where a broken one
    is the chapter's to fix (and ``mkdocs build --strict`` reports it).
    """
    hook = _hook()
    broken = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = hook.SECTION_RE.sub("", page.read_text(encoding="utf-8"))
        for line, in_code in hook._split_lines_outside_fences(text):
            for match in [] if in_code else hook.LINK_RE.finditer(line):
                target = match.group(2).partition("#")[0]
                if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not (page.parent / target).exists():
                    broken.append(f"{page.relative_to(ROOT)}: {match.group(2)}")
    assert not broken, "\n".join(broken)


def test_generated_sections_are_committed_and_current():
    """The docs pages read complete without a build: each generated section is in the file, current."""
    hook = _hook()
    names = {m.group("name") for p in hook.pages_with_sections() for m in hook.SECTION_RE.finditer(p.read_text())}
    assert names == set(hook.GENERATED)
    assert hook.stale_pages() == [], "generated sections are stale: run python docs/hooks/book_pages.py --write"
    for page in hook.pages_with_sections():
        site = hook.fill_sections(page.read_text(encoding="utf-8"), keep_markers=False)
        assert "<!-- book:" not in site and "<!-- /book:" not in site


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "WARNING" not in log, log[-5000:]
    site = tmp_path / "site"
    for page in [
        "index.html",
        "reading-path/index.html",
        "architecture/index.html",
        "results/index.html",
        "glossary/index.html",
        "teaching/index.html",
        "exercises/index.html",
        "sources/index.html",
    ]:
        assert (site / page).is_file(), page
    chapters = sorted(p.parent.name for p in ROOT.glob("0*_*/README.md"))
    for chapter in chapters:
        assert (site / chapter / "index.html").is_file(), f"{chapter}'s README is not in the site"
    for page in site.rglob("*.html"):
        assert "<!-- book:" not in page.read_text(encoding="utf-8"), f"{page}: a generated section was not filled"


def test_every_saved_benchmark_output_still_plots():
    """docs/make_figures.py can redraw each figure from the output it saved (no re-run here)."""
    import matplotlib.pyplot as plt

    spec = importlib.util.spec_from_file_location("vfs_make_figures", ROOT / "docs" / "make_figures.py")
    figures = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = figures  # dataclasses look their module up while the file runs
    spec.loader.exec_module(figures)
    saved = [r for r in figures.RECIPES if (figures.DATA / f"{r.name}.txt").exists()]
    assert saved, "no benchmark output saved under docs/data/"
    for recipe in saved:
        fig, ax = plt.subplots()
        recipe.plot((figures.DATA / f"{recipe.name}.txt").read_text(), ax)
        assert ax.patches, f"{recipe.name}: nothing was drawn"
        plt.close(fig)
    assert figures.markdown_tables("a | b\n--|--\n1 | 2\n") == [[{"a": "1", "b": "2"}]]
    assert figures.number("1,234.5 ms") == 1234.5
