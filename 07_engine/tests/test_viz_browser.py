"""The viewer in a real browser: Debian's headless Chromium driven by Playwright.

Pages are made from a real trace of the default model (``viz_testing.teaching_trace``), and what
the page draws is checked against the trace, step by step: each request's block table, the
reference count of every held block, the queues (a preempted request waits after its step),
no console error. Bad input shows an error naming the line, never a blank page; a trace of
20,000 steps stays responsive. The live ``/viz`` page follows a real server, behind its API key.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from viz_testing import browser_path, teaching_trace
from vllm_from_scratch.step_trace import read_trace
from vllm_from_scratch.tools.viz import render_page, write_page

# Everything the page shows about frame i, read from the DOM (one call for all frames).
READ_FRAMES = """() => {
  const out = [];
  for (let i = 0; i < window.vfs.frameCount(); i++) {
    window.vfs.seek(i);
    const tables = {};
    for (const row of document.querySelectorAll('#tables .bt-row'))
      tables[row.dataset.req] = [...row.querySelectorAll('.bt-cell')].map(c => Number(c.dataset.block));
    const refs = {}, shared = {}, cached = [];
    for (const c of document.querySelectorAll('#grid .blk')) {
      if (c.dataset.ref !== '0') refs[c.dataset.block] = Number(c.dataset.ref);
      if (c.classList.contains('shared')) shared[c.dataset.block] = c.textContent;
      if (c.dataset.lru) cached[Number(c.dataset.lru) - 1] = Number(c.dataset.block);
    }
    const ids = (sel) => [...document.querySelectorAll(sel + ' li[data-req]')].map(li => li.dataset.req);
    out.push({step: document.body.dataset.step, tables, refs, shared, cached,
              waiting: ids('#q-waiting'), running: ids('#q-running'),
              events: [...document.querySelectorAll('#events li[data-kind]')].map(li => li.dataset.kind)});
  }
  return out;
}"""


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    executable = browser_path()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable)
        yield b
        b.close()


@pytest.fixture
def open_page(browser):
    """Open a URL; returns (page, errors) where errors collects console errors and page errors.
    A page from a file is opened offline, as in a classroom without a network: any request it
    makes beyond its own file is an error too."""
    contexts = []

    def _open(url: str, headers: dict | None = None, wait_ready: bool = True):
        context = browser.new_context(viewport={"width": 1300, "height": 900}, extra_http_headers=headers)
        contexts.append(context)
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        if url.startswith("file:"):
            context.set_offline(True)
            page.on(
                "request",
                lambda r: (
                    None
                    if r.url == url or r.url.startswith(("data:", "blob:"))
                    else errors.append(f"the offline page asked for {r.url}")
                ),
            )
        page.goto(url)
        if wait_ready:
            page.wait_for_function("document.body.dataset.ready === '1'", timeout=20_000)
        return page, errors

    yield _open
    for context in contexts:
        context.close()


@pytest.fixture(scope="module")
def trace_page(tmp_path_factory) -> tuple[Path, list[dict]]:
    path, _ = teaching_trace()
    html = tmp_path_factory.mktemp("viz") / "teaching.html"
    write_page(path, html)
    return html, read_trace(path)[1]


@pytest.mark.slow  # the first to ask for the shared trace: it runs the model (a few seconds)
def test_page_draws_what_the_trace_says_at_every_step(open_page, trace_page):
    html, records = trace_page
    page, errors = open_page(html.as_uri())
    frames = page.evaluate(READ_FRAMES)
    assert len(frames) == len(records)
    saw_shared = False
    for rec, shown in zip(records, frames):
        tables = {rid: r["blocks"] for rid, r in rec["requests"].items() if r["blocks"]}
        assert shown["tables"] == tables, f"step {rec['step']}: block tables"
        assert shown["refs"] == rec["blocks"]["ref_counts"], f"step {rec['step']}: reference counts"
        shared = {b: str(n) for b, n in rec["blocks"]["ref_counts"].items() if n > 1}
        assert shown["shared"] == shared, f"step {rec['step']}: shared blocks must show their count"
        saw_shared |= bool(shared)
        assert shown["cached"] == rec["blocks"]["cached_free"], f"step {rec['step']}: eviction order"
        assert shown["waiting"] == [w["id"] for w in rec["waiting"]]
        assert shown["running"] == [r["id"] for r in rec["running"]]
    assert saw_shared
    assert not errors, errors


def test_a_preempted_request_is_called_out_and_waits(open_page, trace_page):
    html, records = trace_page
    page, errors = open_page(html.as_uri())
    frames = page.evaluate(READ_FRAMES)
    preemptions = [(i, rid) for i, rec in enumerate(records) for rid in rec.get("preempted", [])]
    assert preemptions
    for i, rid in preemptions:
        assert "preempt" in frames[i]["events"]
        assert rid in frames[i]["waiting"] and rid not in frames[i]["running"]
        page.evaluate(f"window.vfs.seek({i})")
        badge = page.locator(f'#q-waiting li[data-req="{rid}"] .badge.preempted')
        assert badge.count() == 1
    assert any("hit" in f["events"] for f in frames) and any("evict" in f["events"] for f in frames)
    assert not errors, errors


def test_controls_step_play_and_scrub(open_page, trace_page):
    html, records = trace_page
    page, errors = open_page(html.as_uri())
    assert page.evaluate("window.vfs.current()") == 0
    page.click("#next")
    page.click("#next")
    assert page.evaluate("window.vfs.current()") == 2
    page.click("#prev")
    assert page.evaluate("window.vfs.current()") == 1
    page.fill("#scrub", str(len(records) - 1))
    page.dispatch_event("#scrub", "input")
    assert page.text_content("#pos").startswith("end")
    page.click("#first")
    page.select_option("#speed", "100")
    page.click("#play")
    page.wait_for_function(f"window.vfs.current() === {len(records) - 1}", timeout=10_000)
    assert "play" in page.text_content("#play")  # it stopped at the end
    assert page.locator("#texts .text-row").count() == 4
    assert not errors, errors


def test_bad_input_names_the_line_and_never_blanks_the_page(open_page, trace_page, tmp_path):
    html, records = trace_page
    page, errors = open_page(html.as_uri())
    lines = read_trace_lines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:6] + [lines[6][:50]]) + "\n")
    page.set_input_files("#file", str(cut))
    page.wait_for_function("!document.getElementById('error').hidden")
    assert "cut.jsonl: line 7: not valid JSON" in page.text_content("#error")
    assert page.evaluate("window.vfs.frameCount()") == 5  # the steps before the bad line stay
    assert page.locator("#grid .blk").count() == 16
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    page.set_input_files("#file", str(empty))
    page.wait_for_function("document.getElementById('error').textContent.includes('empty.jsonl')")
    assert "line 1: the trace is empty" in page.text_content("#error")
    # A page whose embedded trace has the wrong schema on its third line (not via the CLI, which refuses it).
    recs = [json.loads(line) for line in lines[:4]]
    recs[2]["schema"] = 2
    bad = tmp_path / "bad.html"
    bad.write_text(render_page({"mode": "file", "source": "bad.jsonl"}, recs))
    page2, _ = open_page(bad.as_uri())
    assert "bad.jsonl: line 3: schema 2, but this viewer reads schema 1" in page2.text_content("#error")
    assert page2.evaluate("window.vfs.frameCount()") == 1
    assert page2.locator("#tables .bt-row").count() > 0


def read_trace_lines() -> list[str]:
    return teaching_trace()[0].read_text().splitlines()


def test_twenty_thousand_steps_stay_responsive(open_page, tmp_path):
    lines = read_trace_lines()
    header, body = json.loads(lines[0]), [json.loads(line) for line in lines[1:-1]]
    steps = [{**body[i % len(body)], "step": i, "new": body[0]["new"] if i == 0 else []} for i in range(20_000)]
    html = tmp_path / "long.html"
    html.write_text(render_page({"mode": "file", "source": "long.jsonl"}, [header, *steps]))
    start = time.perf_counter()
    page, errors = open_page(html.as_uri())
    loaded = time.perf_counter() - start
    seek = page.evaluate("() => { const t = performance.now(); window.vfs.seek(12345); return performance.now() - t; }")
    assert page.evaluate("window.vfs.frameCount()") == 20_000 and page.get_attribute("body", "data-step") == "12345"
    assert loaded < 20 and seek < 500, (loaded, seek)
    assert not errors, errors


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server():
    """The OpenAI server on the default model, in this process, with an API key."""
    import uvicorn

    from vllm_from_scratch import LLMEngine, default_model_dir
    from vllm_from_scratch.api_server import build_app

    engine = LLMEngine(default_model_dir(), num_kvcache_blocks=64, max_model_len=256, enforce_eager=True)
    app = build_app(engine, "SmolLM2-135M-Instruct", api_key="sesame")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.1)
    yield url
    server.should_exit = True
    thread.join(30)


@pytest.mark.slow
def test_live_viz_follows_the_server_and_shows_no_text(open_page, live_server):
    url = live_server
    assert httpx.get(url + "/viz").status_code == 401
    page, errors = open_page(url + "/viz", headers={"Authorization": "Bearer sesame"}, wait_ready=False)
    page.wait_for_function("document.getElementById('meta').textContent.startsWith('live')")
    texts = []

    def ask(i: int) -> None:
        r = httpx.post(
            url + "/v1/completions",
            headers={"Authorization": "Bearer sesame"},
            timeout=120,
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": f"Tell me a fact about the number {i}.",
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        texts.append(r.json()["choices"][0]["text"])

    clients = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for c in clients:
        c.start()
    page.wait_for_function("document.querySelectorAll('#tables .bt-row').length > 0", timeout=60_000)
    labels = page.evaluate("[...document.querySelectorAll('#tables .bt-row')].map(r => r.dataset.req)")
    assert labels and all(label.startswith("r") for label in labels)
    for c in clients:
        c.join(120)
    page.wait_for_function("Number(document.body.dataset.frames) >= 12", timeout=30_000)
    frames = int(page.get_attribute("body", "data-frames"))
    content = page.content()
    assert len(texts) == 3 and all(t.strip() and t not in content for t in texts)
    assert "Tell me a fact" not in content and "cmpl-" not in content
    assert "never shows request text" in page.text_content("#texts")
    assert frames >= 12 and not errors, errors
