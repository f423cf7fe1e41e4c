"""The step trace: off by default, read off the engine's own objects, invariants on every step,
bad files named by line, the Chrome trace, and the live server's redacted stream behind the key.

The real-model trace (``viz_testing.teaching_trace``: SmolLM2, 4 requests, a 16-block cache) is
made once per session and shared with the browser tests; the others run the tiny random Llama.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from viz_testing import TEACHING_ARRIVALS, teaching_trace
from vllm_from_scratch import LLM, LLMEngine, SamplingParams
from vllm_from_scratch.step_trace import SCHEMA, TraceError, check_trace, read_trace, work_kind
from vllm_from_scratch.tools.viz import chrome_trace
from vllm_from_scratch.tools.viz import main as viz_main

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def records(path: Path) -> list[dict]:
    return read_trace(path)[1]


# ---------------------------------------------------------------------------- the real model
def test_off_by_default_and_the_engine_only_checks_for_a_tracer(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kvcache_blocks=32, kvcache_block_size=8, max_model_len=128, enforce_eager=True)
    assert llm.llm_engine.tracer is None
    assert llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0]["token_ids"]


@pytest.mark.slow  # makes the session's real-model trace (a few seconds)
def test_the_default_models_trace_holds_every_invariant_and_shows_every_idea():
    path, texts = teaching_trace()
    summary = check_trace(path)
    assert summary.steps > 10 and summary.ended
    assert summary.requests == {f"req-{i}" for i in range(len(TEACHING_ARRIVALS))}
    assert all(reason == "length" for reason in summary.finished.values())
    assert summary.preemptions > 0 and summary.evictions > 0 and summary.prefix_hit_tokens > 0
    header = read_trace(path)[0]
    assert header["schema"] == SCHEMA and header["model"] == "SmolLM2-135M-Instruct"
    assert header["num_blocks"] == 16 and header["block_size"] == 16
    final = {f["id"]: f["text"] for r in records(path) for f in r.get("finished", [])}
    assert final == texts  # what the engine returned is what the trace says it produced


def test_a_preempted_request_waits_with_no_blocks_after_its_step():
    for rec in records(teaching_trace()[0]):
        for rid in rec.get("preempted", []):
            waiting = {w["id"]: w for w in rec["waiting"]}
            assert waiting[rid]["preempted"] and rec["requests"][rid]["blocks"] == []
            assert rid not in {r["id"] for r in rec["running"]}


def test_shared_blocks_are_the_prefix_hits_of_admitted_requests():
    recs = records(teaching_trace()[0])
    assert any(n > 1 for rec in recs for n in rec["blocks"]["ref_counts"].values())
    for rec in recs:
        for rid, hit in rec.get("prefix_hits", {}).items():
            assert rid in rec["admitted"] and hit % 16 == 0
            start = next(s["start"] for s in rec["scheduled"] if s["id"] == rid)
            assert start == hit  # the first computed position is right after the hit


def test_budget_splits_the_scheduled_tokens_by_kind():
    for rec in records(teaching_trace()[0]):
        if rec["type"] != "step":
            continue
        b = rec["budget"]
        assert b["used"] == sum(s["tokens"] for s in rec["scheduled"]) <= b["total"]
        assert b["used"] == b["prefill"] + b["decode"] + b["verify"]
        for s in rec["scheduled"]:
            assert s["kind"] != "decode" or (s["tokens"] == 1 and len(s["sampled"]) == 1)


def test_work_kind():
    assert work_kind(start=0, num_known=40, num_drafts=0, samples=True, num_prompt_tokens=40) == "prefill"
    assert work_kind(start=0, num_known=16, num_drafts=0, samples=False, num_prompt_tokens=40) == "prefill"
    assert work_kind(start=45, num_known=1, num_drafts=0, samples=True, num_prompt_tokens=40) == "decode"
    assert work_kind(start=39, num_known=1, num_drafts=0, samples=True, num_prompt_tokens=40) == "prefill"
    assert work_kind(start=45, num_known=1, num_drafts=3, samples=True, num_prompt_tokens=40) == "verify"


# ---------------------------------------------------------------------------- the tiny model
def test_drafts_and_acceptances_add_up_to_the_schedulers_counters(tiny_llama_dir, tmp_path):
    path = tmp_path / "spec.jsonl"
    llm = LLM(
        tiny_llama_dir,
        num_kvcache_blocks=64,
        kvcache_block_size=8,
        max_model_len=128,
        step_trace=str(path),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        enforce_eager=True,
    )
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    llm.generate([prompt, prompt[:9]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.scheduler.get_stats()
    llm.shutdown()
    summary = check_trace(path)
    assert summary.drafts == stats["num_draft_tokens"] > 0
    assert summary.accepted == stats["num_accepted_tokens"]
    kinds = {s["kind"] for r in records(path) for s in r.get("scheduled", [])}
    assert "verify" in kinds


def test_aborts_are_recorded_before_and_during_the_run(tiny_llama_dir, tmp_path):
    path = tmp_path / "abort.jsonl"
    engine = LLMEngine(
        tiny_llama_dir,
        num_kvcache_blocks=32,
        kvcache_block_size=8,
        max_model_len=128,
        step_trace=str(path),
        enforce_eager=True,
    )
    for rid in ("a", "b", "c"):
        engine.add_request([3, 4, 5, 6, 7], GREEDY, request_id=rid)
    engine.abort_request("a")  # before any step
    engine.step()
    engine.step()
    engine.abort_request("b")  # holding blocks
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort_request("c")  # already finished: nothing to record
    engine.shutdown()
    summary = check_trace(path)
    assert summary.finished == {"a": "abort", "b": "abort", "c": "length"}
    assert [r["aborted"] for r in records(path) if r["aborted"]] == [["a"], ["b"]]


def test_a_tracer_without_sinks_records_nothing(tiny_llama_dir):
    from vllm_from_scratch.step_trace import StepTracer

    llm = LLM(tiny_llama_dir, num_kvcache_blocks=32, kvcache_block_size=8, max_model_len=128, enforce_eager=True)
    engine = llm.llm_engine
    engine.tracer = StepTracer(engine)
    seen = []
    llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    engine.tracer.add_sink(seen.append)
    llm.generate([[3, 4, 5, 6]], GREEDY, use_tqdm=False)
    assert [r["step"] for r in seen] == list(range(8, 16))  # engine steps keep counting while unwatched
    assert seen[0]["new"][0]["prompt_tokens"] == 4


def test_pool_field_reports_publishes_and_loads(tiny_llama_dir, tmp_path):
    path = tmp_path / "pool.jsonl"
    engine_kwargs = dict(
        num_kvcache_blocks=12,
        kvcache_block_size=8,
        max_model_len=128,
        step_trace=str(path),
        kv_transfer_config={"kv_connector": "embedded"},
    )
    try:
        llm = LLM(tiny_llama_dir, **engine_kwargs, enforce_eager=True)
    except TypeError as exc:  # the connector's setting is not in this tree
        pytest.skip(f"no kv_transfer_config: {exc}")
    shared = list(range(10, 34))  # 3 blocks
    llm.generate([shared + [40]], GREEDY, use_tqdm=False)
    # Other requests take every block, evicting the shared prefix from the local cache.
    llm.generate(
        [list(range(100 + 20 * i, 120 + 20 * i)) for i in range(2)],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    llm.generate([shared + [41]], GREEDY, use_tqdm=False)
    llm.shutdown()
    check_trace(path)
    pools = [r["pool"] for r in records(path) if "pool" in r]
    assert pools and all(set(p) == {"loaded", "published", "totals"} for p in pools)
    assert sum(sum(p["published"].values()) for p in pools) > 0
    assert sum(sum(p["loaded"].values()) for p in pools) == pools[-1]["totals"]["loaded_blocks"] * 8 > 0


# ---------------------------------------------------------------------------- reading and checking
def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "mutate, line, message",
    [
        (lambda lines: [], 1, "empty"),
        (lambda lines: lines[:3] + [lines[3][:40]], 4, "cut short"),
        (lambda lines: [lines[0].replace('"schema": 1', '"schema": 7')] + lines[1:], 1, "schema 7"),
        (lambda lines: lines[1:], 1, "header must be the first line"),
        (lambda lines: lines[:2] + ["[1, 2]"] + lines[3:], 3, "JSON object"),
        (lambda lines: lines[:2] + ['{"schema": 1, "type": "bogus"}'], 3, "unknown record type"),
    ],
)
def test_a_bad_trace_is_named_by_line_in_the_reader_and_the_cli(tmp_path, capsys, mutate, line, message):
    good = teaching_trace()[0].read_text().splitlines()
    bad = _write(tmp_path / "bad.jsonl", mutate(good))
    with pytest.raises(TraceError, match=message) as info:
        read_trace(bad)
    assert info.value.line == line and f"bad.jsonl:{line}:" in str(info.value)
    assert viz_main([str(bad), "-o", str(tmp_path / "bad.html")]) == 2
    assert f"bad.jsonl:{line}:" in capsys.readouterr().err
    assert not (tmp_path / "bad.html").exists()


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("refcount", "reference counts"),
        ("free", "free +"),
        ("unfinished", "never finished"),
        ("gap", "missing"),
    ],
)
def test_check_trace_catches_a_broken_invariant(tmp_path, breakage, message):
    lines = teaching_trace()[0].read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    busy = next(i for i, r in enumerate(recs) if r["type"] == "step" and r["blocks"]["ref_counts"])
    if breakage == "refcount":
        block = next(iter(recs[busy]["blocks"]["ref_counts"]))
        recs[busy]["blocks"]["ref_counts"][block] += 1
    elif breakage == "free":
        recs[busy]["blocks"]["num_free"] += 1
    elif breakage == "unfinished":
        for r in recs[1:]:
            r["finished"] = [f for f in r.get("finished", []) if f["id"] != "req-0"]
    else:
        recs[busy]["step"] += 5
    path = _write(tmp_path / "broken.jsonl", [json.dumps(r) for r in recs])
    with pytest.raises(AssertionError, match=message):
        check_trace(path)


def test_cli_writes_a_self_contained_page_and_checks(tmp_path, capsys):
    path = teaching_trace()[0]
    out = tmp_path / "page.html"
    assert viz_main([str(path), "-o", str(out), "--check", "--chrome-trace", str(tmp_path / "c.json")]) == 0
    page = out.read_text()
    assert "invariants hold" in capsys.readouterr().out
    assert "http://" not in page and "https://" not in page  # nothing fetched when it is viewed
    assert page.count("\n") >= len(path.read_text().splitlines())
    assert_trace_event_format(json.loads((tmp_path / "c.json").read_text()))


def assert_trace_event_format(trace: dict) -> None:
    """What Perfetto and chrome://tracing need of a JSON trace (the Trace Event Format document):
    an object with ``traceEvents``; each event a phase, a process and a thread; complete events
    (``X``) a start and a duration in microseconds; counters (``C``) numeric series; instants
    (``i``) a scope; metadata (``M``) the name it sets."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in {"X", "C", "i", "M"} and isinstance(e["pid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}
            assert "name" in e["args"] or "sort_index" in e["args"]
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        else:
            assert e["s"] in {"t", "p", "g"}, e


def test_embedded_data_cannot_close_the_script_element():
    from vllm_from_scratch.tools.viz import render_page

    page = render_page({"mode": "file"}, [{"text": "</script><script>alert(1)</script>"}])
    assert "alert(1)</script>" not in page and "\\u003c/script>" in page


def test_chrome_trace_has_step_spans_and_each_requests_life(tmp_path):
    header, recs = read_trace(teaching_trace()[0])
    events = chrome_trace(header, recs)["traceEvents"]
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert len(steps) == sum(r["type"] == "step" for r in recs)
    names = {
        e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2
    }
    assert set(names) == {f"req-{i}" for i in range(4)}
    spans = {(e["tid"], e["name"]) for e in events if e["ph"] == "X" and e["pid"] == 2}
    preempted = {rid for r in recs for rid in r.get("preempted", [])}
    for rid, tid in names.items():
        assert {(tid, "queued"), (tid, "prefill"), (tid, "decode")} <= spans
        assert ((tid, "preempted") in spans) == (rid in preempted)
    assert all(e.get("dur", 0) >= 0 for e in events)
    json.dumps(events)


# ---------------------------------------------------------------------------- the chapter demos
ROOT = Path(__file__).resolve().parents[2]


def _block_tables(rec: dict) -> dict[str, list[int]]:
    return {rid: r["blocks"] for rid, r in rec["requests"].items() if r["blocks"]}


def _paged_kv(recs: list[dict]) -> None:
    # What 01's README says of step 1 and what its exercise 7 asks the student to predict.
    assert _block_tables(recs[1]) == {"req-0": [0, 1, 5], "req-1": [2, 3, 4], "req-2": [6, 7, 8]}
    for rid, step, block in (("req-1", 12, 9), ("req-2", 13, 10)):
        fourth = next(r for r in recs if len(r["requests"].get(rid, {}).get("blocks", [])) == 4)
        assert fourth["step"] == step and fourth["requests"][rid]["blocks"][3] == block
    assert any(f["id"] == "req-0" for r in recs if r["step"] < 12 for f in r.get("finished", []))


def _prefix_cache(recs: list[dict]) -> None:
    admitted = next(r for r in recs if "req-3" in r.get("admitted", []))
    assert admitted["prefix_hits"]["req-3"] == 32
    assert admitted["blocks"]["ref_counts"][str(_block_tables(admitted)["req-3"][0])] == 4


def _scheduler(recs: list[dict]) -> None:
    i = next(i for i, r in enumerate(recs) if r.get("preempted"))
    victim = recs[i]["preempted"][0]
    assert victim == "req-3" and recs[i]["waiting"][0] == {"id": victim, "priority": 0, "preempted": True}
    assert recs[i]["requests"][victim]["blocks"] == [] and recs[i]["blocks"]["cached_free"]
    assert any(victim in r.get("prefix_hits", {}) for r in recs[i + 1 :])  # re-admitted, its prompt cached
    assert any(r["blocks"]["evicted"] for r in recs[i + 1 :])


def _spec_decode(recs: list[dict]) -> None:
    verify = [s for r in recs for s in r.get("scheduled", []) if s["kind"] == "verify"]
    assert verify and max(s["accepted"] for s in verify) == 4
    assert all(len(s["sampled"]) == s["accepted"] + 1 for s in verify)


def _chunked_prefill(recs: list[dict]) -> None:
    # The long prompt (req-2) in chunks of 46 beside the two decodes, sampling at its last chunk only.
    chunks = [
        r
        for r in recs
        if any(s["id"] == "req-2" and s["kind"] == "prefill" and not s["sampled"] for s in r["scheduled"])
    ]
    assert len(chunks) == 215 // 46
    for r in chunks:
        assert r["budget"] == {"total": 48, "used": 48, "prefill": 46, "decode": 2, "verify": 0}
    assert chunks[0]["admitted"] == ["req-2"] and chunks[0]["requests"]["req-2"]["tokens"] == 215


DEMOS = {
    "01_paged_kv": _paged_kv,
    "03_prefix_cache": _prefix_cache,
    "04_scheduler": _scheduler,
    "05_spec_decode": _spec_decode,
    "06_chunked_prefill": _chunked_prefill,
}


@pytest.mark.slow  # the default model through each demo's scenario: 5-10 s each on two cores
@pytest.mark.parametrize("chapter", DEMOS)
def test_each_chapter_demo_traces_its_idea_in_the_real_engine(chapter, tmp_path):
    path = tmp_path / "trace.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / chapter / "demo.py"), "--trace", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "invariants hold" in out.stdout and f"python -m vllm_from_scratch.tools.viz {path}" in out.stdout
    assert check_trace(path).ended and read_trace(path)[0]["model"] == "SmolLM2-135M-Instruct"
    DEMOS[chapter]([r for r in records(path) if r["type"] == "step"])


@pytest.mark.parametrize("script", ["07_engine/benchmarks/bench_step_trace.py", "docs/make_screenshots.py"])
def test_the_trace_scripts_have_help(script):
    out = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]


# ---------------------------------------------------------------------------- the live stream
def test_viz_routes_need_the_api_key_and_redact_the_stream(tiny_llama_dir):
    import asyncio

    from vllm_from_scratch.api_server import build_app

    engine = LLMEngine(
        tiny_llama_dir, num_kvcache_blocks=32, kvcache_block_size=8, max_model_len=128, enforce_eager=True
    )
    app = build_app(engine, "tiny", api_key="sesame")
    live = app.state.viz
    sent = []

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for path in ("/viz", "/viz/events"):
                assert (await client.get(path)).status_code == 401
            page = await client.get("/viz", headers={"Authorization": "Bearer sesame"})
            assert page.status_code == 200 and '"mode":"live"' in page.text
        # The stream itself, driven without HTTP: a fake disconnect after two records.
        request = _FakeRequest(after=3)
        stream = live.events(request)
        sent.append(await stream.__anext__())
        engine.add_request([3, 4, 5, 6], GREEDY, request_id="secret-id")
        while engine.has_unfinished_requests():
            engine.step()
        async for chunk in stream:
            sent.append(chunk)

    asyncio.run(scenario())
    engine.shutdown()
    assert sent[0].startswith("event: header") and '"redacted":true' in sent[0]
    body = "".join(sent)
    assert "secret-id" not in body and '"sampled"' not in body and '"text"' not in body
    steps = [json.loads(c[len("data: ") :]) for c in sent[1:] if c.startswith("data: ")]
    assert steps and steps[0]["new"][0]["id"] == "r1" and steps[0]["new"][0]["prompt_tokens"] == 4
    assert not live.tracer._sinks  # the last viewer left: the engine records nothing again


class _FakeRequest:
    """Starlette's ``is_disconnected`` after ``after`` polls."""

    def __init__(self, after: int):
        self.polls = after

    async def is_disconnected(self) -> bool:
        self.polls -= 1
        return self.polls < 0
