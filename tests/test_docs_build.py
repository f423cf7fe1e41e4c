"""The book's site builds with `mkdocs build --strict`, and the build hook publishes the chapters.

The strict build fails on any warning: a broken link, a page missing from the nav, a nav entry
without a page. The hook (docs/hooks/book_pages.py) is tested directly for its link rewriting.
"""

import importlib.util
import os
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
