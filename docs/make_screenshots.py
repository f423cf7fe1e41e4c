"""Redraw the chapter READMEs' viewer screenshots: each chapter's idea, caught in the engine.

For each chapter, its demo's ``--trace`` runs the chapter's scenario through the real engine on
the default model; the trace becomes a viewer page (``python -m vllm_from_scratch.tools.viz``);
headless Chromium opens it at the step that teaches the idea and saves the screenshot beside
the chapter's README:

| chapter | the step shown | file |
| --- | --- | --- |
| 01 | the first step where a third request holds blocks | ``01_paged_kv/viz_block_tables.png`` |
| 03 | the step with the most requests sharing the system prompt's blocks | ``03_prefix_cache/viz_shared_prefix.png`` |
| 04 | the first preemption | ``04_scheduler/viz_preemption.png`` |
| 05 | the verify step that accepted the most drafts | ``05_spec_decode/viz_accepted_drafts.png`` |
| 06 | the first prompt chunk that runs beside decodes | ``06_chunked_prefill/viz_chunked_prompt.png`` |

    python docs/make_screenshots.py                 # all five (about a minute on two cores)
    python docs/make_screenshots.py --only 04 06

Needs Debian's ``chromium-headless-shell`` and Playwright (``./setup.sh`` installs both).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "07_engine"))  # viz_testing: where the browser is found

from viz_testing import BROWSER_PATHS  # noqa: E402
from vllm_from_scratch.step_trace import Record, read_trace  # noqa: E402
from vllm_from_scratch.tools.viz import write_page  # noqa: E402

VIEWPORT = {"width": 1300, "height": 820}


@dataclass
class Shot:
    """One chapter's screenshot: its demo, the frame that teaches the idea, the PNG."""

    chapter: str
    png: str
    moment: Callable[[list[Record]], int]


def _first(records: list[Record], test: Callable[[Record], bool]) -> int:
    return next(i for i, r in enumerate(records) if test(r))


def _best(records: list[Record], score: Callable[[Record], float]) -> int:
    return max(range(len(records)), key=lambda i: (score(records[i]), -i))


def _beside_decodes(r: Record) -> bool:
    kinds = [s["kind"] for s in r.get("scheduled", [])]
    chunk = any(s["kind"] == "prefill" and not s["sampled"] for s in r.get("scheduled", []))
    return chunk and "decode" in kinds


SHOTS = [
    Shot(
        "01_paged_kv",
        "viz_block_tables.png",
        lambda rs: _first(rs, lambda r: sum(bool(q["blocks"]) for q in r["requests"].values()) == 3),
    ),
    Shot(
        "03_prefix_cache",
        "viz_shared_prefix.png",
        lambda rs: _best(
            rs,
            lambda r: (
                sum(n > 1 for n in r["blocks"]["ref_counts"].values())
                + max(r["blocks"]["ref_counts"].values(), default=0)
            ),
        ),
    ),
    Shot("04_scheduler", "viz_preemption.png", lambda rs: _first(rs, lambda r: bool(r.get("preempted")))),
    Shot(
        "05_spec_decode",
        "viz_accepted_drafts.png",
        lambda rs: _best(rs, lambda r: sum(s["accepted"] for s in r.get("scheduled", []))),
    ),
    Shot("06_chunked_prefill", "viz_chunked_prompt.png", lambda rs: _first(rs, _beside_decodes)),
]


def screenshot(shot: Shot, workdir: Path, browser) -> Path:
    """Run the chapter's demo with ``--trace``, make its page, save the teaching frame."""
    trace = workdir / f"{shot.chapter}.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / shot.chapter / "demo.py"), "--trace", str(trace)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    html = workdir / f"{shot.chapter}.html"
    write_page(trace, html)
    frame = shot.moment(read_trace(trace)[1])
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(html.as_uri())
    page.wait_for_function("document.body.dataset.ready === '1'")
    page.evaluate(f"window.vfs.seek({frame})")
    out = ROOT / shot.chapter / shot.png
    page.screenshot(path=str(out))
    page.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="CHAPTER", help="chapter numbers, e.g. 04 06")
    args = parser.parse_args()
    shots = [s for s in SHOTS if not args.only or s.chapter[:2] in args.only]
    from playwright.sync_api import sync_playwright

    browser_path = next((p for p in BROWSER_PATHS if Path(p).exists()), None)
    if browser_path is None:
        sys.exit("headless Chromium not found: apt-get install chromium-headless-shell (./setup.sh does it)")
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path)
        for shot in tqdm(shots, desc="screenshots", unit="chapter"):
            print(f"wrote {screenshot(shot, Path(tmp), browser).relative_to(ROOT)}")
        browser.close()


if __name__ == "__main__":
    main()
