// The step-trace viewer: replays a trace written by vllm_from_scratch.step_trace (schema 1).
// Plain JavaScript, no build step, no network: viz.py inlines this file into every page.
// Frames are the trace's step records. Each line is parsed once to index it (the timeline,
// the text) in chunks that keep the page responsive, then parsed again when shown (an LRU
// cache keeps the recent ones), so a trace of many thousands of steps costs little memory.
"use strict";
(() => {
  const SCHEMA = 1;
  const CACHE_SIZE = 256;        // parsed frames kept
  const INDEX_CHUNK = 1000;      // lines indexed between two paints
  const LIVE_MAX_FRAMES = 5000;  // a live page keeps the latest frames only
  const MAX_CELLS = 16384;       // blocks drawn in the pool grid
  const F = { PREEMPT: 1, EVICT: 2, HIT: 4, POOL: 8, DRAFT: 16, END: 32 };
  const MARKS = [[F.PREEMPT, "--preempt"], [F.EVICT, "--evict"], [F.HIT, "--hit"], [F.POOL, "--pool"],
                 [F.DRAFT, "--verify"], [F.END, "--end"]];
  const $ = (id) => document.getElementById(id);

  const S = {
    header: null, headerText: "", source: "", lines: [], index: [], cache: new Map(), reqs: new Map(), texts: new Map(),
    cur: -1, timer: null, live: false, cells: [], cellKey: [], indexing: false, liveEvents: 0, drawPending: false,
  };

  // ------------------------------------------------------------------ errors: never a blank page
  class TraceError extends Error {
    constructor(where, message) { super(`${where}: ${message}`); }
  }
  function showError(message) { const e = $("error"); e.textContent = message; e.hidden = false; }
  function clearError() { const e = $("error"); e.textContent = ""; e.hidden = true; }
  function status(message) { $("status").textContent = message; }
  function guarded(fn) {
    return (...args) => { try { return fn(...args); } catch (err) { showError(err.message || String(err)); } };
  }
  window.addEventListener("error", (ev) => showError(`viewer error: ${ev.message}`));
  window.addEventListener("unhandledrejection", (ev) => showError(`viewer error: ${ev.reason && ev.reason.message || ev.reason}`));

  function parseRecord(text, where, isHeader) {
    let rec;
    try {
      rec = JSON.parse(text);
    } catch (err) {
      throw new TraceError(where, `not valid JSON (${err.message}); a cut-short last line means the run ` +
                                  `was stopped while writing it`);
    }
    if (rec === null || typeof rec !== "object" || Array.isArray(rec)) throw new TraceError(where, "expected a JSON object");
    if (rec.schema !== SCHEMA) {
      throw new TraceError(where, `schema ${JSON.stringify(rec.schema)}, but this viewer reads schema ${SCHEMA}`);
    }
    if (isHeader && rec.type !== "header") {
      throw new TraceError(where, `the first line must be the header, got type ${JSON.stringify(rec.type)}`);
    }
    if (!isHeader && rec.type !== "step" && rec.type !== "end") {
      throw new TraceError(where, `expected a step or end record, got type ${JSON.stringify(rec.type)}`);
    }
    if (!isHeader && (typeof rec.blocks !== "object" || typeof rec.requests !== "object")) {
      throw new TraceError(where, "a step record needs its blocks and requests");
    }
    return rec;
  }
  const lineName = (i) => (S.live ? `live event ${i + 1}` : `line ${i + 2}`);

  // ------------------------------------------------------------------ loading and indexing
  function reset() {
    pause();
    Object.assign(S, { header: null, headerText: "", lines: [], index: [], cur: -1, indexing: false });
    S.cache.clear(); S.reqs.clear(); S.texts.clear();
    clearError();
  }

  function setHeader(header, source) {
    S.header = header;
    S.source = source;
    const s = header.settings || {};
    const flags = [s.enable_prefix_caching && "prefix caching", s.enable_chunked_prefill && "chunked prefill",
                   s.speculative_config && "speculative decoding", s.scheduling_policy].filter(Boolean);
    $("meta").textContent = `${source}: ${header.model}, ${header.num_blocks} blocks of ${header.block_size} tokens, ` +
      `budget ${header.token_budget} tokens/step, max ${header.max_num_seqs} requests; ${flags.join(", ")}`;
    buildGrid();
  }

  function loadText(text, source) {
    reset();
    const lines = text.split("\n");
    if (lines.length && lines[lines.length - 1] === "") lines.pop();
    if (!lines.length || !lines[0].trim()) throw new TraceError("line 1", "the trace is empty (no header line)");
    setHeader(parseRecord(lines[0], "line 1", true), source);
    S.lines = lines.slice(1);
    S.indexing = true;
    document.body.dataset.ready = "0";
    indexFrom(0);
  }

  function indexFrom(start) {
    const end = Math.min(S.lines.length, start + INDEX_CHUNK);
    let i = start;
    try {
      for (; i < end; i++) ingest(parseRecord(S.lines[i], lineName(i), false), i);
    } catch (err) {
      S.lines.length = i;  // the frames before the bad line stay viewable
      S.indexing = false;
      finishIndexing();
      showError(`${S.source}: ${err.message}`);
      return;
    }
    if (S.cur < 0 && S.index.length) seek(0);
    if (i < S.lines.length) {
      status(`indexing ${i} / ${S.lines.length} steps…`);
      updateScrub(); scheduleDraw();
      setTimeout(guarded(() => indexFrom(i)), 0);
    } else {
      S.indexing = false;
      finishIndexing();
    }
  }

  function finishIndexing() {
    status(S.index.length ? "" : "the trace has a header but no step yet");
    updateScrub(); scheduleDraw();
    if (S.index.length) seek(Math.max(S.cur, 0));
    document.body.dataset.ready = "1";
  }

  function addRequest(id, info) {
    if (S.reqs.has(id)) return S.reqs.get(id);
    const n = S.reqs.size;
    const r = { id, color: `hsl(${(n * 137.508) % 360}, 62%, 46%)`, info: info || {}, ended: null };
    S.reqs.set(id, r);
    return r;
  }

  function ingest(rec, i) {
    for (const n of rec.new || []) addRequest(n.id, n);
    for (const s of rec.scheduled || []) addRequest(s.id);
    for (const rid of Object.keys(rec.requests)) addRequest(rid);
    for (const f of rec.finished || []) addRequest(f.id).ended = { frame: i, reason: f.reason };
    for (const rid of rec.aborted || []) addRequest(rid).ended = { frame: i, reason: "abort" };
    for (const [rid, piece] of Object.entries(rec.text || {})) {
      let list = S.texts.get(rid);
      if (!list) S.texts.set(rid, (list = []));
      list.push([i, (list.length ? list[list.length - 1][1] : "") + piece]);
    }
    const b = rec.budget || { total: S.header.token_budget, prefill: 0, decode: 0, verify: 0 };
    S.index.push({ step: rec.step, type: rec.type, total: b.total, prefill: b.prefill, decode: b.decode,
                   verify: b.verify, flags: flagsOf(rec) });
  }

  function flagsOf(rec) {
    let f = 0;
    if ((rec.preempted || []).length) f |= F.PREEMPT;
    if ((rec.blocks.evicted || []).length) f |= F.EVICT;
    if (Object.keys(rec.prefix_hits || {}).length) f |= F.HIT;
    if (rec.pool && Object.values(rec.pool.loaded || {}).some((n) => n > 0)) f |= F.POOL;
    if ((rec.scheduled || []).some((s) => s.accepted > 0)) f |= F.DRAFT;
    if ((rec.finished || []).length || (rec.aborted || []).length) f |= F.END;
    return f;
  }

  function frame(i) {
    let rec = S.cache.get(i);
    if (rec) { S.cache.delete(i); S.cache.set(i, rec); return rec; }
    rec = parseRecord(S.lines[i], lineName(i), false);
    S.cache.set(i, rec);
    if (S.cache.size > CACHE_SIZE) S.cache.delete(S.cache.keys().next().value);
    return rec;
  }

  // ------------------------------------------------------------------ live: server-sent events
  async function connectLive(url) {
    S.live = true;
    $("follow-wrap").hidden = false;
    status("connecting to the engine…");
    let resp;
    try {
      resp = await fetch(url, { cache: "no-store", headers: { Accept: "text/event-stream" } });
    } catch (err) {
      status(`cannot reach ${url} (${err.message}); retrying…`);
      setTimeout(() => connectLive(url), 2000);
      return;
    }
    if (resp.status === 401) {
      showError(`${url}: 401 Unauthorized. This server has an API key: send "Authorization: Bearer <key>" ` +
                `with every request to /viz (docs/step_trace.md says how).`);
      return;
    }
    if (!resp.ok) {
      showError(`${url}: HTTP ${resp.status}`);
      setTimeout(() => connectLive(url), 5000);
      return;
    }
    clearError();
    status("live: waiting for the engine to run a step…");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, k);
        buf = buf.slice(k + 2);
        guarded(onEvent)(block);
      }
    }
    status("the server closed the stream; reconnecting…");
    setTimeout(() => connectLive(url), 1000);
  }

  function onEvent(block) {
    let name = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (!data.length) return;  // a keep-alive comment
    const text = data.join("\n");
    S.liveEvents += 1;
    if (name === "header") {
      if (text !== S.headerText) {  // a new server (or the first connection)
        reset();
        S.headerText = text;
        setHeader(parseRecord(text, `live event ${S.liveEvents}`, true), "live");
      }
      return;
    }
    if (!S.header) throw new TraceError(`live event ${S.liveEvents}`, "a step arrived before the header");
    const rec = parseRecord(text, `live event ${S.liveEvents}`, false);
    const i = S.lines.length;
    S.lines.push(text);
    ingest(rec, i);
    S.cache.set(i, rec);
    if (S.lines.length > LIVE_MAX_FRAMES) dropOldest(LIVE_MAX_FRAMES / 5);
    status(`live: ${S.index.length} steps kept`);
    document.body.dataset.frames = String(S.index.length);
    updateScrub(); scheduleDraw();
    if ($("follow").checked || S.cur < 0) seek(S.index.length - 1);
  }

  function dropOldest(n) {
    S.lines.splice(0, n); S.index.splice(0, n); S.cache.clear();
    S.cur = Math.max(0, S.cur - n);
  }

  // ------------------------------------------------------------------ navigation
  function updateScrub() {
    const scrub = $("scrub");
    scrub.max = String(Math.max(0, S.index.length - 1));
    if (S.cur >= 0) scrub.value = String(S.cur);
  }
  function seek(i) {
    if (!S.index.length) return;
    S.cur = Math.max(0, Math.min(S.index.length - 1, i | 0));
    render(S.cur);
  }
  function play() {
    if (S.timer || !S.index.length) return;
    if (S.cur >= S.index.length - 1 && !S.live) seek(0);
    $("play").textContent = "\u275A\u275A pause";
    // A replay stops in the tick that shows its last step, so the button never says "pause" at the end.
    S.timer = setInterval(guarded(() => {
      if (S.cur < S.index.length - 1) seek(S.cur + 1);
      if (S.cur >= S.index.length - 1 && !S.live) pause();
    }), 1000 / Number($("speed").value));
  }
  function pause() {
    if (S.timer) clearInterval(S.timer);
    S.timer = null;
    $("play").textContent = "\u25B6 play";
  }

  // ------------------------------------------------------------------ rendering one frame
  function render(i) {
    const rec = frame(i);
    $("scrub").value = String(i);
    $("pos").textContent = `${rec.type === "end" ? "end" : "step " + rec.step}  (${i + 1} / ${S.index.length})`;
    document.body.dataset.frame = String(i);
    document.body.dataset.step = String(rec.step);
    $("step-meta").textContent = rec.type === "end" ? "the run ended: the final state" :
      `step ${rec.step}, at ${fmtSeconds(rec.t)}, took ${fmtSeconds(rec.duration)}`;
    renderBudget(rec); renderScheduled(rec); renderEvents(rec); renderQueues(rec);
    renderGrid(rec); renderTables(rec); renderTexts(i); drawCursor();
  }

  const fmtSeconds = (s) => (s === undefined ? "?" : s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`);
  const colorOf = (rid) => addRequest(rid).color;
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "style") node.style.cssText = v;
      else if (k.startsWith("data-")) node.dataset[k.slice(5).replace(/-(\w)/g, (_, c) => c.toUpperCase())] = v;
      else node[k] = v;
    }
    for (const c of children) node.append(c);
    return node;
  }
  const swatch = (rid) => el("span", { className: "swatch", style: `background:${colorOf(rid)}` });

  function renderBudget(rec) {
    const bar = $("budget-bar");
    bar.textContent = "";
    const b = rec.budget;
    if (!b) { $("budget-text").textContent = "no work in this record"; return; }
    for (const s of rec.scheduled) {
      const label = `${s.id} ${s.tokens}`;
      bar.append(el("div", { className: `seg ${s.kind}`, title: `${s.id}: ${s.kind}, ${s.tokens} tokens`,
                             style: `width:${(100 * s.tokens) / b.total}%;background-color:${colorOf(s.id)}`,
                             "data-req": s.id, "data-kind": s.kind, "data-tokens": String(s.tokens) }, label));
    }
    const unused = b.total - b.used;
    if (unused > 0) bar.append(el("div", { className: "seg unused", style: `width:${(100 * unused) / b.total}%` }, `${unused} unused`));
    $("budget-text").textContent = `token budget ${b.used} / ${b.total} used: prompt chunks ${b.prefill}, ` +
      `decodes ${b.decode}, speculative verify ${b.verify}`;
  }

  function renderScheduled(rec) {
    const body = $("sched").tBodies[0];
    body.textContent = "";
    for (const s of rec.scheduled || []) {
      const work = s.kind === "prefill" ? `prompt ${s.start}–${s.start + s.tokens}` : s.kind;
      body.append(el("tr", { "data-req": s.id },
        el("td", {}, swatch(s.id), s.id), el("td", { className: `kind-${s.kind}` }, work),
        el("td", {}, String(s.tokens)), el("td", {}, `${s.start} → ${s.computed}`),
        el("td", {}, s.drafts ? `${s.accepted} / ${s.drafts}` : "–")));
    }
    if (!body.rows.length) body.append(el("tr", {}, el("td", { className: "empty", colSpan: 5 }, "nothing scheduled")));
  }

  function eventsOf(rec) {
    const bs = S.header.block_size;
    const out = [];
    const hits = rec.prefix_hits || {};
    for (const rid of rec.admitted || []) {
      const n = hits[rid] || 0;
      out.push(n ? ["hit", `${rid} admitted: ${n} prompt tokens (${n / bs} blocks) found in the prefix cache, not computed`]
                 : ["admit", `${rid} admitted`]);
    }
    for (const rid of rec.preempted || []) {
      out.push(["preempt", `${rid} preempted: its blocks went back to the pool; it waits to be recomputed`]);
    }
    const evicted = rec.blocks.evicted || [];
    if (evicted.length) {
      out.push(["evict", `block${evicted.length > 1 ? "s" : ""} ${evicted.join(", ")} evicted from the prefix cache ` +
                         `(least recently used first) and reused`]);
    }
    for (const s of rec.scheduled || []) {
      if (s.drafts) out.push(["draft", `${s.id}: ${s.accepted} of ${s.drafts} draft tokens accepted`]);
      const decodes = (rec.scheduled || []).filter((x) => x.kind !== "prefill").length;
      const info = S.reqs.get(s.id).info;
      if (s.kind === "prefill" && info.prompt_tokens && s.start + s.tokens < info.prompt_tokens) {
        out.push(["chunk", `${s.id}: prompt chunk ${s.start}–${s.start + s.tokens} of ${info.prompt_tokens}` +
                           (decodes ? ` beside ${decodes} decode${decodes > 1 ? "s" : ""}` : "") + ", no token sampled yet"]);
      }
    }
    const pool = rec.pool || {};
    for (const [rid, n] of Object.entries(pool.loaded || {})) if (n) out.push(["pool", `${rid} loaded ${n} tokens from the global KV pool`]);
    for (const [rid, n] of Object.entries(pool.published || {})) if (n) out.push(["pool", `${rid} published ${n} blocks to the global KV pool`]);
    for (const f of rec.finished || []) out.push(["end", `${f.id} finished (${f.reason}) after ${f.completion_tokens} tokens; its blocks went back`]);
    for (const rid of rec.aborted || []) out.push(["end", `${rid} aborted: its blocks went back`]);
    return out;
  }

  function renderEvents(rec) {
    const list = $("events");
    list.textContent = "";
    for (const [kind, text] of eventsOf(rec)) list.append(el("li", { className: kind, "data-kind": kind }, text));
    if (!list.children.length) list.append(el("li", { className: "empty" }, "nothing new: every scheduled request advanced"));
  }

  function renderQueues(rec) {
    const fill = (id, items) => {
      const ol = $(id);
      ol.textContent = "";
      for (const [rid, ...badges] of items) ol.append(el("li", { "data-req": rid }, swatch(rid), rid, ...badges));
      if (!items.length) ol.append(el("li", { className: "empty" }, "empty"));
    };
    const prio = (p) => el("span", { className: "badge", title: "priority (lower runs first)" }, `p${p}`);
    fill("q-waiting", (rec.waiting || []).map((w) => [w.id, prio(w.priority),
      ...(w.preempted ? [el("span", { className: "badge preempted" }, "preempted")] : [])]));
    fill("q-loading", (rec.loading || []).map((rid) => [rid]));
    fill("q-running", (rec.running || []).map((r) => [r.id, prio(r.priority)]));
  }

  function owners(rec) {
    const map = new Map();
    for (const [rid, r] of Object.entries(rec.requests)) {
      for (const b of r.blocks) { if (!map.has(b)) map.set(b, []); map.get(b).push(rid); }
    }
    return map;
  }

  function buildGrid() {
    const grid = $("grid");
    grid.textContent = "";
    const n = Math.min(S.header.num_blocks, MAX_CELLS);
    document.documentElement.style.setProperty("--cell", n <= 256 ? "26px" : n <= 1024 ? "16px" : "9px");
    grid.classList.toggle("small", n > 256);
    const frag = document.createDocumentFragment();
    S.cells = []; S.cellKey = [];
    for (let b = 0; b < n; b++) {
      const c = el("div", { className: "blk", title: `block ${b}: free`, "data-block": String(b) });
      S.cells.push(c); S.cellKey.push("");
      frag.append(c);
    }
    grid.append(frag);
    $("grid-note").textContent = S.header.num_blocks > n ? `blocks ${n}–${S.header.num_blocks - 1} are not drawn` : "";
  }

  function renderGrid(rec) {
    const held = rec.blocks.ref_counts;
    const cached = rec.blocks.cached_free || [];
    const lru = new Map(cached.map((b, k) => [b, k + 1]));
    const evicted = new Set(rec.blocks.evicted || []);
    const own = owners(rec);
    let numHeld = 0, numShared = 0;
    for (let b = 0; b < S.cells.length; b++) {
      const ref = held[b] || 0;
      const who = own.get(b) || [];
      let cls = "blk free", label = "", title = `block ${b}: free`;
      if (ref) {
        numHeld += 1; numShared += ref > 1;
        cls = ref > 1 ? "blk held shared" : "blk held";
        label = ref > 1 ? String(ref) : "";
        title = `block ${b}: held by ${who.join(", ")}, reference count ${ref}`;
      } else if (lru.has(b)) {
        cls = "blk cached";
        label = String(lru.get(b));
        title = `block ${b}: free, still holds a cached prefix; evicted ${lru.get(b)} of ${cached.length}`;
      }
      if (evicted.has(b)) { cls += " evicted"; title += "; evicted this step: its cached content was dropped"; }
      const key = `${cls}|${label}|${who.join(",")}`;
      if (S.cellKey[b] === key) continue;
      S.cellKey[b] = key;
      const c = S.cells[b];
      c.className = cls; c.textContent = label; c.title = title;
      c.style.background = ref ? colorOf(who[0] || "?") : "";
      c.dataset.owner = who[0] || ""; c.dataset.ref = String(ref);
      if (lru.has(b)) c.dataset.lru = String(lru.get(b)); else delete c.dataset.lru;
    }
    $("pool-sum").textContent = `${rec.blocks.num_free} free (${cached.length} of them cached), ${numHeld} held, ` +
      `${numShared} shared`;
  }

  function renderTables(rec) {
    const box = $("tables");
    box.textContent = "";
    const held = rec.blocks.ref_counts;
    const bs = S.header.block_size;
    for (const [rid, r] of Object.entries(rec.requests)) {
      if (!r.blocks.length) continue;
      const cells = r.blocks.map((b, k) => {
        const ref = held[b] || 0;
        return el("span", { className: `bt-cell${ref > 1 ? " shared" : ""}${k * bs >= r.computed ? " uncomputed" : ""}`,
                            style: `background:${colorOf(rid)}`, title: `logical block ${k} → physical block ${b}` +
                            (ref > 1 ? `, shared (reference count ${ref})` : ""), "data-block": String(b),
                            "data-logical": String(k), "data-ref": String(ref) },
                  String(b), ...(ref > 1 ? [el("sup", {}, `×${ref}`)] : []));
      });
      box.append(el("div", { className: "bt-row", "data-req": rid },
        el("span", { className: "bt-label" }, swatch(rid), `${rid} ${r.status} ${r.computed}/${r.tokens} tokens`),
        el("span", { className: "bt-cells" }, ...cells)));
    }
    if (!box.children.length) box.append(el("span", { className: "empty" }, "no request holds blocks"));
  }

  function textAt(list, i) {
    let lo = 0, hi = list.length - 1, found = -1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (list[mid][0] <= i) { found = mid; lo = mid + 1; } else hi = mid - 1;
    }
    return found;
  }

  function renderTexts(i) {
    const box = $("texts");
    box.textContent = "";
    if (S.header.redacted) {
      box.append(el("span", { className: "empty" }, "the live page never shows request text (docs/step_trace.md)"));
      return;
    }
    for (const [rid, list] of S.texts) {
      const k = textAt(list, i);
      if (k < 0) continue;
      const [at, text] = list[k];
      const before = at === i && k > 0 ? list[k - 1][1] : at === i ? "" : text;
      const r = S.reqs.get(rid);
      const done = r.ended && r.ended.frame <= i;
      box.append(el("div", { className: `text-row${done ? " done" : ""}`, "data-req": rid },
        el("div", {}, swatch(rid), rid, done ? ` (${r.ended.reason})` : ""),
        el("div", { className: "text-body" }, before, ...(text.length > before.length ? [el("mark", {}, text.slice(before.length))] : []))));
    }
    if (!box.children.length) box.append(el("span", { className: "empty" }, "no text yet"));
  }

  // ------------------------------------------------------------------ the timeline
  function scheduleDraw() {
    if (S.drawPending) return;
    S.drawPending = true;
    requestAnimationFrame(guarded(() => { S.drawPending = false; drawTimeline(); drawCursor(); }));
  }

  function sizeCanvas(cv) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(cv.clientWidth * dpr)), h = Math.max(1, Math.round(cv.clientHeight * dpr));
    if (cv.width !== w || cv.height !== h) { cv.width = w; cv.height = h; }
    return [w, h, dpr];
  }

  // More steps than pixels: each column shows its busiest step, and the marks of all its steps.
  function drawTimeline() {
    const cv = $("timeline");
    const [W, H, dpr] = sizeCanvas(cv);
    const ctx = cv.getContext("2d");
    ctx.clearRect(0, 0, W, H);
    const n = S.index.length;
    if (!n) return;
    const css = getComputedStyle(document.documentElement);
    const color = (v) => css.getPropertyValue(v).trim();
    const top = 14 * dpr, barH = H - top - 2 * dpr;
    // Scaled to the busiest step; the budget line shows when it is within reach of the bars.
    const maxUsed = S.index.reduce((m, x) => Math.max(m, x.prefill + x.decode + x.verify), 1);
    const budget = S.header.token_budget;
    const maxTotal = budget <= 1.6 * maxUsed ? Math.max(budget, maxUsed) : 1.15 * maxUsed;
    const cols = Math.min(W, n), colW = W / cols;
    for (let c = 0; c < cols; c++) {
      const lo = Math.floor((c * n) / cols), hi = Math.max(lo + 1, Math.floor(((c + 1) * n) / cols));
      let best = S.index[lo], flags = 0;
      for (let k = lo; k < hi; k++) {
        const x = S.index[k];
        flags |= x.flags;
        if (x.prefill + x.decode + x.verify > best.prefill + best.decode + best.verify) best = x;
      }
      let y = H - 2 * dpr;
      for (const [part, v] of [["prefill", "--prefill"], ["decode", "--decode"], ["verify", "--verify"]]) {
        const h = ((best[part] || 0) / maxTotal) * barH;
        ctx.fillStyle = color(v);
        ctx.fillRect(c * colW, y - h, Math.max(colW - (colW > 3 ? 1 : 0), 1), h);
        y -= h;
      }
      let mx = 0;
      for (const [bit, v] of MARKS) {
        if (flags & bit) { ctx.fillStyle = color(v); ctx.fillRect(c * colW, mx, Math.max(colW, 1), 2 * dpr); }
        mx += 2 * dpr;
      }
    }
    if (budget <= maxTotal) {
      ctx.strokeStyle = "#999"; ctx.setLineDash([4 * dpr, 3 * dpr]);
      const yb = H - 2 * dpr - (budget / maxTotal) * barH;
      ctx.beginPath(); ctx.moveTo(0, yb); ctx.lineTo(W, yb); ctx.stroke(); ctx.setLineDash([]);
    }
    $("scale").textContent = `bar height: tokens per step, full height ${Math.round(maxTotal)}` +
      (budget <= maxTotal ? `; dashed: the budget (${budget})` : `; the budget (${budget}) is off the scale`);
  }

  function drawCursor() {
    const cv = $("cursor");
    const [W, H, dpr] = sizeCanvas(cv);
    const ctx = cv.getContext("2d");
    ctx.clearRect(0, 0, W, H);
    if (S.cur < 0 || !S.index.length) return;
    const x = ((S.cur + 0.5) / S.index.length) * W;
    ctx.fillStyle = "rgba(0,0,0,.75)";
    ctx.fillRect(x - dpr, 0, 2 * dpr, H);
  }

  // ------------------------------------------------------------------ wiring
  function highlight(block, on) {
    for (const node of document.querySelectorAll(`[data-block="${block}"]`)) node.classList.toggle("hl", on);
  }

  function wire() {
    $("first").onclick = guarded(() => seek(0));
    $("prev").onclick = guarded(() => seek(S.cur - 1));
    $("next").onclick = guarded(() => seek(S.cur + 1));
    $("last").onclick = guarded(() => seek(S.index.length - 1));
    $("play").onclick = guarded(() => (S.timer ? pause() : play()));
    $("speed").onchange = guarded(() => { if (S.timer) { pause(); play(); } });
    $("scrub").oninput = guarded(() => seek(Number($("scrub").value)));
    $("timeline").onclick = guarded((ev) => {
      const r = ev.currentTarget.getBoundingClientRect();
      seek(Math.floor(((ev.clientX - r.left) / r.width) * S.index.length));
    });
    $("file").onchange = guarded(async (ev) => {
      const file = ev.target.files[0];
      if (!file) return;
      S.live = false;
      try { loadText(await file.text(), file.name); } catch (err) { showError(`${file.name}: ${err.message}`); }
    });
    for (const id of ["grid", "tables"]) {
      $(id).addEventListener("mouseover", (ev) => { const t = ev.target.closest("[data-block]"); if (t) highlight(t.dataset.block, true); });
      $(id).addEventListener("mouseout", (ev) => { const t = ev.target.closest("[data-block]"); if (t) highlight(t.dataset.block, false); });
    }
    document.addEventListener("keydown", guarded((ev) => {
      if (ev.target.tagName === "INPUT" || ev.target.tagName === "SELECT") return;
      const keys = { ArrowLeft: () => seek(S.cur - 1), ArrowRight: () => seek(S.cur + 1), Home: () => seek(0),
                     End: () => seek(S.index.length - 1), " ": () => (S.timer ? pause() : play()) };
      if (keys[ev.key]) { ev.preventDefault(); keys[ev.key](); }
    }));
    window.addEventListener("resize", scheduleDraw);
  }

  function start() {
    wire();
    window.vfs = { seek: guarded(seek), frameCount: () => S.index.length, current: () => S.cur,
                   frame: (i) => frame(i), header: () => S.header };
    let config;
    try {
      config = JSON.parse($("vfs-config").textContent);
    } catch (err) {
      showError(`the page's configuration is unreadable: ${err.message}`);
      return;
    }
    if (config.mode === "live") {
      connectLive(config.events);
      return;
    }
    const text = $("vfs-trace").textContent;
    if (!text.trim()) { status("no trace in this page: open one with the button above"); document.body.dataset.ready = "1"; return; }
    try { loadText(text, config.source || "trace"); } catch (err) { showError(`${config.source || "trace"}: ${err.message}`); document.body.dataset.ready = "1"; }
  }

  start();
})();
