"""Seed 000's own test file for the local prefix cache passes unchanged from its chapter folder."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "03_prefix_cache"
SEED = ROOT.parent / "shared" / "seeds" / "000_4ef08cd682b4c23a.txt"


def test_seed_test_file_passes_when_run_from_inside_the_chapter():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_prefix_cache_local.py"],
        cwd=CHAPTER,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


@pytest.mark.skipif(not SEED.exists(), reason="the seed documents (../shared/seeds) are not beside this checkout")
def test_seed_test_file_is_verbatim():
    text = SEED.read_text(encoding="utf-8")
    start = text.index("# vllm-from-scratch/03_prefix_cache/test_prefix_cache_local.py")
    listing = text[start : text.index("```", start)]
    assert (CHAPTER / "test_prefix_cache_local.py").read_text(encoding="utf-8") == listing
