"""Every command the book tells a reader to type names something that exists.

The READMEs and docs say ``python -m vllm_from_scratch.serve ...`` and ``python 07_engine/benchmarks/bench.py
...``. Moving or renaming a module or a script leaves such a line behind, and the reader finds
out by typing it. This test reads every Markdown file of the repository and checks that each
``python -m vllm_from_scratch.<module>`` answers ``--help``, and that each ``python <path>.py`` is
a file of the repository (the scripts' own tests run their ``--help``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {"site", "node_modules"}  # built pages and vendored packages, plus every dot-directory
MODULE_RE = re.compile(r"python3? -m (vllm_from_scratch(?:\.\w+)+)")
SCRIPT_RE = re.compile(r"python3? ((?:[\w.-]+/)*[\w.-]+\.py)\b")


def markdown_files() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(part.startswith(".") or part in SKIPPED_DIRS for part in p.relative_to(ROOT).parts[:-1])
    )


def commands(regex: re.Pattern[str]) -> dict[str, list[str]]:
    """What ``regex`` captures in the Markdown files -> where ("path:line")."""
    found: dict[str, list[str]] = {}
    for path in markdown_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in regex.findall(line):
                found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


def test_documented_modules_run_as_scripts():
    modules = commands(MODULE_RE)
    assert "vllm_from_scratch.serve" in modules, "the scan found none of the book's commands"
    broken = []
    for module, where in sorted(modules.items()):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        if out.returncode != 0 or "usage" not in out.stdout:
            broken.append(f"{module} (named at {', '.join(where)}): {out.stderr.strip()[-300:]}")
    assert not broken, "`python -m` commands that do not run:\n" + "\n".join(broken)


def test_documented_scripts_exist():
    scripts = commands(SCRIPT_RE)
    assert "07_engine/benchmarks/bench.py" in scripts, "the scan found none of the book's scripts"
    broken = [f"{s} (named at {', '.join(where)})" for s, where in scripts.items() if not (ROOT / s).is_file()]
    assert not broken, "`python <script>` commands naming no file:\n" + "\n".join(broken)
