"""The book speaks of itself alone, and introduces its sources before it cites them.

Checked in every Markdown file of the repository (``git ls-files``, untracked new pages included):

* a line that names a source document ("seed 000" … "seed 004") links to ``docs/sources.md``,
  the page that says what each one is: a reader of the book does not have them;
* nothing cites the notes kept beside the sources (``NOTES``): a reader does not have those
  either, so a fact stands on a command of the repository or is not stated;
* no sentence tells how or when the book was made (what was lent or asked for, a session, an
  issue): the text describes the code, which is what a reader has;
* no prose quotes test counts or test times ("42 passed", "59 tests, 75 s"): they change with
  every test added, and a run of pytest says them better.
"""

from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = "docs/sources.md"

SEED_RE = re.compile(r"\bseeds? 00[0-4]\b", re.I)
SEED_SPLIT_RE = re.compile(r"\bseeds?[ \t]*\n[ \t>]*00[0-4]\b", re.I)  # a name broken over two lines
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
NOTES_RE = re.compile(r"\bNOTES\b")
MAKING_PHRASES = (
    "been lent",
    "was lent",
    "were lent",
    "no gpu was",
    "this session",
    "the issue",
    "asked for",
    "while it was written",
    "when it was written",
    "was available",
    "were available",
    "at the time of writing",
)
# "42 tests", "50 passed, 6 skipped", "passed in 8.5 s"; not "0 failed" requests of a benchmark.
TEST_COUNT_RE = re.compile(r"\b\d[\d,]*\s+(?:tests?|passed)\b|\bpassed in \d", re.I)


def markdown_files() -> list[str]:
    """Repository paths of the book's Markdown files, minus those excluded until rewritten."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every .md outside dot dirs
        out = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*.md")
            if not any(part.startswith(".") or part == "site" for part in p.relative_to(ROOT).parts)
        ]
    return sorted(p for p in set(out) if (ROOT / p).is_file())


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (MkDocs) and GitHub both give a plain heading."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def sources_anchors() -> set[str]:
    text = (ROOT / SOURCES).read_text(encoding="utf-8")
    ids = set(re.findall(r"<a id=\"([^\"]+)\"></a>", text))
    return ids | {slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def links_to_sources(path: str, line: str, anchors: set[str]) -> bool:
    """Does ``line`` of ``path`` link to the sources page (at an anchor that exists)?"""
    for target in LINK_RE.findall(line):
        file, _, anchor = target.partition("#")
        if file and posixpath.normpath(posixpath.join(posixpath.dirname(path), file)) == SOURCES:
            if not anchor or anchor in anchors:
                return True
    return False


def problems(path: str, text: str, anchors: set[str]) -> list[str]:
    """Every breach of the module's four rules in ``text`` (the file ``path``)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{number}"
        if path != SOURCES and SEED_RE.search(line) and not links_to_sources(path, line, anchors):
            found.append(f"{where}: names a source without linking to {SOURCES}: {line.strip()}")
        if NOTES_RE.search(line):
            found.append(f"{where}: cites NOTES, which a reader does not have: {line.strip()}")
        lowered = line.lower()
        for phrase in MAKING_PHRASES:
            if phrase in lowered:
                found.append(f"{where}: tells how the book was made ({phrase!r}): {line.strip()}")
        if m := TEST_COUNT_RE.search(line):
            found.append(f"{where}: quotes a test count or time ({m.group(0)!r}): {line.strip()}")
    for m in SEED_SPLIT_RE.finditer(text):
        found.append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}: a source's name is split over two lines")
    return found


@pytest.mark.parametrize("path", markdown_files())
def test_page_speaks_of_the_book_alone(path):
    found = problems(path, (ROOT / path).read_text(encoding="utf-8"), sources_anchors())
    assert not found, "\n".join(found)


def test_the_sources_page_names_every_source():
    anchors = sources_anchors()
    assert {f"seed-00{i}" for i in range(5)} <= anchors


@pytest.mark.parametrize(
    "line, why",
    [
        ("as seed 004 shows", "without linking"),
        ("as [seed 004](../docs/sources.md#seed-009) shows", "without linking"),  # no such anchor
        ("as [seed 004](sources.md#seed-004) shows", "without linking"),  # resolves to 01_paged_kv/sources.md
        ("NOTES.md measured it", "cites NOTES"),
        ("No GPU has been lent to this chapter.", "how the book was made"),
        ("`pytest 01_paged_kv/ -q`: 42 passed in 8.5 s", "test count"),
        ("pytest 04_scheduler/ -q      # 39 tests, about 6 s", "test count"),
    ],
)
def test_the_check_catches(line, why):
    found = problems("01_paged_kv/README.md", line + "\n", sources_anchors())
    assert len(found) == 1 and why in found[0], found


def test_the_check_passes_a_linked_source_and_ordinary_numbers():
    text = (
        "As [seed 004](../docs/sources.md#seed-004) and [seed 001](../docs/sources.md) show,\n"
        "a random workload of 5 seeds, 85,857 steps, 6 need a GPU and skip; 128 requests, 0 failed.\n"
    )
    assert problems("01_paged_kv/README.md", text, sources_anchors()) == []
    split = "as seed\n004 shows\n"
    assert "split over two lines" in problems("README.md", split, sources_anchors())[-1]
