// agentrl view: the list, filters, curves and side-by-side. Served, data comes from /api; exported, from
// the JSON embedded in the page. Text from samples is set with textContent only: the sample markup
// (escaped by the server) is the one thing inserted as HTML.
"use strict";
(function () {
  const $ = (sel) => document.querySelector(sel);
  const el = (tag, text, attrs) => {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  };
  const PAGE = 100;
  const embedded = JSON.parse($("#agentrl-data").textContent);
  const state = { step: null, offset: 0, total: 0, selected: null, run: null, reported: new Set() };

  // -- data sources: the API, or the exported page's own data -----------------------------------------
  async function getJSON(url) {
    const r = await fetch(url);
    const body = await r.json().catch(() => ({ detail: r.statusText }));
    if (!r.ok) throw new Error(typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail));
    return body;
  }
  function keeps(s, f) {
    return (f.reward_min === "" || s.reward >= Number(f.reward_min)) &&
      (f.reward_max === "" || s.reward <= Number(f.reward_max)) &&
      (!f.status || s.status === f.status) && (!f.outcome || s.outcomes.includes(f.outcome)) &&
      (!f.stop_reason || s.stop_reason === f.stop_reason) && (!f.task || s.task === f.task) &&
      (!f.q || s.text.includes(f.q.toLowerCase()));
  }
  const source = embedded ? {
    run: async () => embedded.run,
    metrics: async () => embedded.metrics,
    page: async (step, f, offset) => {
      state.reported.add(step); // its errors came with the run
      const kept = (embedded.samples[step] || []).filter((s) => keeps(s, f));
      return { total: kept.length, items: kept.slice(offset, offset + PAGE) };
    },
    sample: async (step, index) => {
      const article = document.getElementById(`s-${step}-${index}`);
      const summary = (embedded.samples[step] || []).find((s) => s.index === index);
      return { summary, node: article.cloneNode(true) };
    },
  } : {
    run: () => getJSON("api/run"),
    metrics: () => getJSON("api/metrics"),
    page: (step, f, offset) => {
      const q = new URLSearchParams({ offset, limit: PAGE });
      for (const [k, v] of Object.entries(f)) if (v !== "") q.set(k, v);
      return getJSON(`api/steps/${encodeURIComponent(step)}/samples?${q}`);
    },
    sample: async (step, index) => {
      const body = await getJSON(`api/steps/${encodeURIComponent(step)}/samples/${encodeURIComponent(index)}`);
      const node = el("article", null, { class: "sample" });
      node.innerHTML = body.html; // server-rendered, every sample string escaped
      return { summary: body.summary, node };
    },
  };

  function showErrors(lines) {
    const box = $("#errors");
    const all = (box.dataset.lines ? JSON.parse(box.dataset.lines) : []).concat(lines);
    box.dataset.lines = JSON.stringify(all);
    box.textContent = all.join("\n");
    box.hidden = all.length === 0;
  }

  // -- curves: hand-drawn SVG (no plotting library to vendor) -----------------------------------------
  function drawCurves(rows) {
    const series = [
      { key: "rollout/reward_mean", name: "train reward (mean)", cls: "series-reward" },
      { key: "eval_accuracy", name: "held-out accuracy", cls: "series-heldout" },
    ].map((s) => ({ ...s, points: rows.filter((r) => typeof r.step === "number" && typeof r[s.key] === "number")
      .map((r) => [r.step, r[s.key]]) }));
    const box = $("#curve");
    box.replaceChildren();
    const all = series.flatMap((s) => s.points);
    if (!all.length) { box.append(el("p", "metrics.jsonl has no reward or held-out rows yet")); return; }
    const NS = "http://www.w3.org/2000/svg", W = 640, H = 220, L = 40, R = 160, T = 10, B = 30;
    const svg = document.createElementNS(NS, "svg");
    const add = (tag, attrs, text) => {
      const n = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
      if (text !== undefined) n.textContent = text;
      svg.append(n);
      return n;
    };
    svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("role", "img");
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
    const y0 = Math.min(0, ...ys), y1 = Math.max(1, ...ys);
    const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), Y = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    add("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B });
    add("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B });
    add("text", { x: L, y: H - 8 }, `step ${x0}`); add("text", { x: W - R - 40, y: H - 8 }, `step ${x1}`);
    add("text", { x: 2, y: H - B }, String(y0)); add("text", { x: 2, y: T + 10 }, String(y1));
    series.forEach((s, k) => {
      if (!s.points.length) return;
      add("polyline", { class: `series ${s.cls}`, "data-key": s.key,
        points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ") });
      for (const p of s.points) add("circle", { class: s.cls, cx: X(p[0]), cy: Y(p[1]), r: 2.5 });
      add("line", { class: s.cls, x1: W - R + 10, y1: T + 12 + 18 * k, x2: W - R + 30, y2: T + 12 + 18 * k });
      add("text", { x: W - R + 34, y: T + 16 + 18 * k }, s.name);
    });
    box.append(svg);
  }

  // -- list, filters, detail --------------------------------------------------------------------------
  function filters() {
    const f = Object.fromEntries(new FormData($("#filters")).entries());
    delete f.step;
    return f;
  }
  function row(s) {
    const tr = el("tr", null, { "data-index": s.index });
    for (const v of [s.index, s.reward, s.status, s.stop_reason || "", s.outcomes.join(", "), s.tokens, s.trained,
      s.question]) tr.append(el("td", v));
    tr.addEventListener("click", () => select(s.index, tr));
    return tr;
  }
  async function load(reset) {
    if (reset) { state.offset = 0; $("#samples tbody").replaceChildren(); }
    if (state.step === null) { $("#count").textContent = "this run logged no samples"; return; }
    try {
      const page = await source.page(state.step, filters(), state.offset);
      if (page.errors && page.errors.length && !state.reported.has(state.step)) {
        state.reported.add(state.step);
        showErrors(page.errors);
      }
      page.items.forEach((s) => $("#samples tbody").append(row(s)));
      state.offset += page.items.length;
      state.total = page.total;
      $("#count").textContent = `${page.total} samples match at step ${state.step} (showing ${state.offset})`;
      $("#more").hidden = state.offset >= page.total;
    } catch (err) { showErrors([`step ${state.step}: ${err.message}`]); }
  }
  async function select(index, tr) {
    document.querySelectorAll("#samples tr.selected").forEach((r) => r.classList.remove("selected"));
    if (tr) tr.classList.add("selected");
    try {
      const got = await source.sample(state.step, index);
      got.node.hidden = false;
      state.selected = got.summary;
      $("#detail").replaceChildren(el("h3", `step ${state.step} · sample ${index} · ${got.summary.question}`), got.node);
      $("#other").hidden = true;
      $("#compare-bar").hidden = false;
    } catch (err) { showErrors([err.message]); }
  }
  async function compare() {
    const other = Number($("#compare-step").value), s = state.selected;
    const pane = $("#other");
    pane.hidden = false;
    try {
      const page = await source.page(other, { ...Object.fromEntries(Object.keys(filters()).map((k) => [k, ""])),
        task: s.task }, 0);
      if (!page.items.length) { pane.replaceChildren(el("p", `step ${other} logged no sample of this task`)); return; }
      const got = await source.sample(other, page.items[0].index);
      got.node.hidden = false;
      pane.replaceChildren(el("h3", `step ${other} · sample ${got.summary.index} · same task`), got.node);
    } catch (err) { pane.replaceChildren(el("p", err.message)); }
  }
  function hover(event) {
    const tok = event.target.closest ? event.target.closest(".tok") : null;
    const box = $("#hover");
    if (!tok) { box.hidden = true; return; }
    box.textContent = tok.getAttribute("title").split(" | ").join("\n");
    box.style.left = `${event.clientX + 12}px`; box.style.top = `${event.clientY + 12}px`;
    box.hidden = false;
  }

  function options(select, values) {
    for (const v of values) select.append(el("option", v, { value: v }));
  }
  async function start() {
    try {
      const run = state.run = await source.run();
      const ck = run.checkpoints;
      $("#run-facts").textContent = `steps with samples: ${run.steps.map((s) => s.step).join(", ") || "none"}` +
        ` · checkpoints: ${ck.steps.map((s) => `step-${s}`).join(", ") || "none"}` + (ck.latest ? ` (latest ${ck.latest})` : "");
      showErrors(run.steps.flatMap((s) => s.errors)); // exported: every step was read
      for (const [name, label] of Object.entries(run.classes)) {
        $("#legend").append(el("span", `${name}: ${label}`, { class: "swatch tok", "data-provenance": name }));
      }
      const form = $("#filters");
      options(form.status, run.statuses); options(form.outcome, run.outcomes); options(form.stop_reason, run.stop_reasons);
      options($("#f-step"), run.steps.map((s) => String(s.step)));
      options($("#compare-step"), run.steps.map((s) => String(s.step)));
      state.step = run.steps.length ? run.steps[run.steps.length - 1].step : null;
      if (state.step !== null) $("#f-step").value = String(state.step);
    } catch (err) { showErrors([err.message]); }
    source.metrics().then((m) => { showErrors(m.errors || []); drawCurves(m.rows); })
      .catch((err) => showErrors([`metrics: ${err.message}`]));
    $("#f-step").addEventListener("change", (e) => { state.step = Number(e.target.value); load(true); });
    let timer = null;
    $("#filters").addEventListener("input", (e) => {
      if (e.target.name === "step") return;
      clearTimeout(timer); timer = setTimeout(() => load(true), 150);
    });
    $("#more").addEventListener("click", () => load(false));
    $("#compare").addEventListener("click", compare);
    document.addEventListener("mouseover", hover);
    await load(true);
    document.body.dataset.ready = "1";
  }
  start();
})();
