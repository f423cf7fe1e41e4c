"""Every page of chapter 07 stays readable in one sitting, and says each thing once.

Chapter 07's README is an overview; its deeper topics are pages of their own in
``07_engine/topics/``. A page that grows past 400 lines is two pages, and a heading that comes
back within a page ("Exercises", "Measured results") is two texts stitched together.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from exercise_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
FENCE_RE = re.compile(r"^\s*(```|~~~)")
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
PAGES = sorted(p for p in (ROOT / "07_engine").rglob("*.md") if not any(part.startswith(".") for part in p.parts))


def headings(text: str) -> list[str]:
    """The page's Markdown headings, outside code fences (a ``# comment`` in a shell block is none)."""
    found, in_code = [], False
    for line in text.splitlines():
        if FENCE_RE.match(line):
            in_code = not in_code
        elif not in_code and (m := HEADING_RE.match(line)):
            found.append(m.group(2))
    return found


def test_the_chapter_has_its_overview_and_topic_pages():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert "07_engine/README.md" in names
    assert any(n.startswith("07_engine/topics/") for n in names), "no topic page under 07_engine/topics/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_fits_one_sitting(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"{page.relative_to(ROOT)}: {len(lines)} lines, more than {MAX_LINES}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_heading_repeats_within_a_page(page):
    seen = headings(page.read_text(encoding="utf-8"))
    repeated = sorted({h for h in seen if seen.count(h) > 1})
    assert not repeated, f"{page.relative_to(ROOT)}: headings repeated: {repeated}"


def test_each_exercise_points_at_the_page_that_lists_it():
    """A stub's error names a page's Exercises section (make_stubs.readme_anchor): that page exists
    and its section lists the exercise, in every chapter (07.S1a and 07.S1b may be listed as 07.S1)."""
    ep = load_script("exercise_plugin")
    make_stubs = load_script("make_stubs")
    for ex in ep.load_exercises():
        page, _, anchor = make_stubs.readme_anchor(ex).partition("#")
        assert anchor == "exercises" and (ROOT / page).is_file(), f"{ex.id}: no page {page}"
        text = (ROOT / page).read_text(encoding="utf-8")
        section = text.split("\n## Exercises\n", 1)
        assert len(section) == 2, f"{page} has no '## Exercises' section ({ex.id} points there)"
        listed = re.sub(r"[a-z]$", "", ex.id)
        names = f"{re.escape(ex.id)}|{re.escape(listed)}"
        assert re.search(rf"\*\*({names})[* ]", section[1].split("\n## ", 1)[0]), (
            f"{page}#exercises does not list {listed} ({ex.id})"
        )


def test_headings_are_found_outside_code_only():
    text = "# Title\n\n## Exercises\n\n```bash\n# a comment\n## not a heading\n```\n\n## Proof\n"
    assert headings(text) == ["Title", "Exercises", "Proof"]
