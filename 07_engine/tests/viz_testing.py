"""What the step-trace and viewer tests share: one real trace of the default model, made once per
test session, and the headless browser they look at pages with.

The trace is SmolLM2-135M-Instruct on a KV cache of 16 blocks of 16 tokens: four chat requests
share the chat template's system prompt (prefix hits, shared blocks with reference counts
above 1), and their 40-token answers do not all fit, so requests are preempted and cached
blocks evicted. About 50 steps, a few seconds on two cores.

The browser is Debian's headless Chromium (``apt-get install chromium-headless-shell``, done by
``./setup.sh``) driven by Playwright for Python, whose own browser download is not used. In CI
(``CI`` set) a missing browser fails the tests; elsewhere they skip with the reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from vllm_from_scratch.tools.viz import Arrival, trace_scenario

TEACHING_ARRIVALS = [
    Arrival("Write a short poem about the sea.", 40),
    Arrival("List three fruits.", 40),
    Arrival("What is a block table?", 40),
    Arrival("Count from one to ten.", 40),
]
TEACHING_ENGINE = dict(num_kvcache_blocks=16, max_num_batched_tokens=256, max_model_len=256)
BROWSER_PATHS = ("/usr/bin/chromium-headless-shell", "/usr/bin/chromium")


@functools.cache
def teaching_trace() -> tuple[Path, dict[str, str]]:
    """The session's trace file and each request's final text (made on first use)."""
    path = Path(tempfile.mkdtemp(prefix="vfs-trace-")) / "teaching.jsonl"
    texts = trace_scenario(path, TEACHING_ARRIVALS, **TEACHING_ENGINE)
    return path, texts


def browser_path() -> str:
    """Debian's headless Chromium; fails in CI and skips elsewhere when it is not installed."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("Playwright for Python is not installed (pip install -r requirements.txt)")
    found = next((p for p in BROWSER_PATHS if os.access(p, os.X_OK)), None) or shutil.which("chromium-headless-shell")
    if found is None:
        _unavailable("headless Chromium is not installed (apt-get install chromium-headless-shell; ./setup.sh does it)")
    return found


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"browser tests cannot run in CI: {reason}")
    pytest.skip(f"BROWSER TESTS SKIPPED: {reason}")
