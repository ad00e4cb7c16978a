// actbus dashboard: renders snapshots from /events (server-sent events). No libraries.
"use strict";
const $ = (s) => document.querySelector(s);
const normHistory = {};           // tap -> recent norm means, for the time series
const HISTORY = 120;
let updates = 0, source = null, tapWanted = new URLSearchParams(location.search).get("tap");

function fmt(v, digits = 3) {
  if (v === undefined || v === null) return "-";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return v.toLocaleString("en");
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return v.toFixed(digits);
}
function bytes(v) {
  if (!v) return "0 B";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return v.toFixed(1) + " " + u[i];
}
function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
const NS = "http://www.w3.org/2000/svg";
function svg(w, h) { const s = document.createElementNS(NS, "svg"); s.setAttribute("width", w); s.setAttribute("height", h); s.setAttribute("viewBox", `0 0 ${w} ${h}`); return s; }
function rect(s, x, y, w, h, fill) { const r = document.createElementNS(NS, "rect"); for (const [k, v] of Object.entries({ x, y, width: Math.max(w, 0.5), height: Math.max(h, 0), fill })) r.setAttribute(k, v); s.appendChild(r); }
function bars(values, w, h, fill, title) {
  const s = svg(w, h), max = Math.max(...values, 1e-12), bw = w / Math.max(values.length, 1);
  values.forEach((v, i) => rect(s, i * bw, h - (v / max) * h, bw * 0.9, (v / max) * h, fill));
  if (title) { const t = document.createElementNS(NS, "title"); t.textContent = title; s.appendChild(t); }
  return s;
}
function line(values, w, h, stroke) {
  const s = svg(w, h); if (values.length < 2) return s;
  const lo = Math.min(...values), hi = Math.max(...values), span = hi - lo || 1;
  const pts = values.map((v, i) => `${(i / (values.length - 1)) * w},${h - 2 - ((v - lo) / span) * (h - 4)}`);
  const p = document.createElementNS(NS, "polyline");
  p.setAttribute("points", pts.join(" ")); p.setAttribute("fill", "none"); p.setAttribute("stroke", stroke); p.setAttribute("stroke-width", "1.5");
  s.appendChild(p); return s;
}
function cards(root, items) {
  root.replaceChildren(...items.map(([id, k, v]) => {
    const c = el("div", { class: "card" }); c.append(el("div", { class: "v", id }, v), el("div", { class: "k" }, k)); return c;
  }));
}

function feed(s) {
  // Whether these figures are current: the server says when its data feed stopped.
  const banner = $("#feed"), state = s.feed || "live", status = $("#status");
  banner.className = "banner" + (state === "stopped" ? " stopped" : "");
  if (state === "stale") {
    banner.textContent = `Stale: no new data for over ${fmt(s.stale_s)} s (the publisher is gone or the consumer is stuck); the figures below are from ${s.time ? new Date(s.time * 1000).toLocaleTimeString() : "before"}.`;
  } else if (state === "stopped") {
    banner.textContent = `Stopped: the dashboard's consumer gave up (${s.feed_error || "see its log"}); the figures below are its last.`;
  }
  banner.hidden = !(state === "stale" || state === "stopped");
  status.textContent = state === "live" || state === "waiting" ? "live" : state;
  status.className = "pill " + (state === "live" || state === "waiting" ? "live" : "stale");
}

function render(s) {
  updates++;
  feed(s);
  $("#updates").textContent = updates;
  $("#updated").textContent = s.time ? new Date(s.time * 1000).toLocaleTimeString() : "-";
  $("#model").textContent = s.model || "";
  const b = s.bus || {}, me = s.me || {}, acts = s.acts || {};
  cards($("#bus-cards"), [
    ["bus-steps-per-s", "steps/s", fmt(b.steps_per_s, 1)],
    ["bus-tokens-per-s", b.tokens_counted ? "tokens/s" : "tokens/s (est. from samples)", fmt(b.tokens_per_s, 1)],
    ["bus-bytes-per-s", "sent/s", bytes(b.bytes_per_s || 0) + "/s"],
    ["bus-last-step", "last step", fmt(b.last_step)],
    ["bus-published", "messages published", fmt(b.published)],
    ["bus-drops", "drops (all reasons)", fmt(b.drops_total)],
    ["bus-spill", "spilled now", bytes(b.spill_bytes || 0)],
    ["bus-queued", "queued", bytes(b.queued_bytes || 0)],
    ["bus-stall", "engine stalled (s)", fmt(b.stall_s, 2)],
    ["bus-capture", "engine time in capture / publisher CPU", `${fmt(100 * (b.capture_frac || 0), 2)} % / ${fmt(100 * (b.publisher_cpu_frac || 0), 2)} %`],
    ["bus-latency", "capture→send p50 / p99 ms", `${fmt(b.latency_p50_ms, 2)} / ${fmt(b.latency_p99_ms, 2)}`],
  ]);
  const subs = $("#subscribers tbody"); subs.replaceChildren();
  for (const [name, lag] of Object.entries(b.lag_steps || {})) {
    const tr = el("tr"); tr.append(el("td", {}, name), el("td", {}, fmt(lag)), el("td", {}, fmt((b.sub_dropped || {})[name] || 0))); subs.append(tr);
  }
  cards($("#me-cards"), [
    ["me-sample", "this dashboard samples", s.sample_per_s ? `at most ${fmt(s.sample_per_s)} steps/s` : `every ${s.sample_every || 1} steps`],
    ["me-steps", "steps counted", fmt(me.steps_counted)],
    ["me-received", "messages received", fmt(me.received)],
    ["me-dropped", "dropped for it", fmt(Object.values(me.dropped || {}).reduce((a, c) => a + c, 0))],
    ["me-rows", "rows digested", fmt(acts.rows)],
    ["me-nonfinite", "rows with NaN/Inf (left out)", fmt(acts.nonfinite_rows || 0)],
  ]);
  if (acts.nonfinite_rows) $("#me-nonfinite").classList.add("bad");
  // Fan-in: what came from each publisher (engine, DP rank, run).
  const pubs = Object.entries(s.publishers || {}), ptab = $("#publishers");
  ptab.hidden = pubs.length < 2;
  ptab.querySelector("tbody").replaceChildren(...pubs.map(([addr, p]) => {
    const tr = el("tr", { "data-publisher": addr });
    tr.append(el("td", {}, addr), el("td", {}, fmt(p.dp_rank)), el("td", {}, (p.publisher_id || "-").slice(0, 8)),
      el("td", {}, fmt(p.messages)), el("td", {}, fmt(p.rows)), el("td", {}, fmt(p.last_step)));
    return tr;
  }));
  const taps = acts.taps || {}, tbody = $("#taps tbody"); tbody.replaceChildren();
  for (const [key, t] of Object.entries(taps)) {
    (normHistory[key] = normHistory[key] || []).push(t.norm_mean || 0);
    if (normHistory[key].length > HISTORY) normHistory[key].shift();
    const tr = el("tr", { "data-tap": key });
    const hist = el("td"), ts = el("td");
    if (t.norm_hist) hist.append(bars(t.norm_hist.counts, 160, 32, "#3b6ea5", `norms ${fmt(t.norm_hist.edges[0])} .. ${fmt(t.norm_hist.edges.at(-1))}`));
    ts.append(line(normHistory[key], 140, 32, "#c0392b"));
    tr.append(el("td", {}, key), el("td", {}, fmt(t.rows)), el("td", { class: "norm-mean" }, fmt(t.norm_mean)), el("td", {}, fmt(t.norm_std)),
      hist, ts, el("td", {}, fmt(t.mean_drift)), el("td", {}, fmt(t.var_drift)), el("td", {}, t.outlier_frac === undefined ? "-" : (100 * t.outlier_frac).toFixed(2) + " %"),
      el("td", t.nonfinite_rows ? { class: "nonfinite bad" } : { class: "nonfinite" }, fmt(t.nonfinite_rows || 0)));
    tbody.append(tr);
  }
  const tags = $("#tags tbody"); tags.replaceChildren();
  for (const [label, per] of Object.entries(acts.tags || {})) for (const [key, v] of Object.entries(per)) {
    const tr = el("tr"); tr.append(el("td", {}, label), el("td", {}, key), el("td", {}, fmt(v.rows)), el("td", {}, fmt(v.norm_mean))); tags.append(tr);
  }
  const sel = $("#tap"), keys = Object.keys(taps);
  if ([...sel.options].map((o) => o.value).join() !== keys.join()) sel.replaceChildren(...keys.map((k) => el("option", { value: k }, k)));
  if (s.tap) sel.value = s.tap;
  renderMonitors(s.monitors || {});
  renderExperts(s.experts);
  const reqs = $("#requests"); reqs.replaceChildren();
  for (const r of s.requests || []) {
    const d = el("div", { class: "req" });
    const tagText = Object.entries(r.tags || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    d.append(el("div", {}, ""));
    d.firstChild.append(el("span", { class: "id" }, r.request_id + (r.sample_index ? `#${r.sample_index}` : "")),
      el("span", { class: "muted" }, `  ${r.positions.length} tokens sampled${r.ended ? ", ended: " + r.ended : ""}${tagText ? ", " + tagText : ""}`));
    if (r.norms.length) d.append(bars(r.norms, Math.min(900, 6 * r.norms.length + 20), 48, "#2a7d46", `positions ${r.positions[0]}..${r.positions.at(-1)}`));
    reqs.append(d);
  }
}

const scoreHistory = {};         // series/column -> recent means, for the time series
function columnName(s, c, i) { return c.label !== null && c.label !== undefined ? `f${c.label}` : (s.width > 1 ? `c${i}` : "score"); }
function exact(v) { return v === null || v === undefined ? "" : String(v); }
function renderMonitors(m) {
  // Monitor scores: every text goes in through textContent, so peer strings (monitor
  // names, tags, request ids) are never parsed as HTML.
  const series = Object.entries(m.series || {}), status = $("#monitor-status");
  const notes = [];
  if (m.error) notes.push(`scores left out: ${m.error}`);
  else if (!series.length) notes.push(m.subscribed ? "No monitor scores yet: no request asked for a monitor." : "No monitor scores: the engine has no monitors (or --no-monitor-scores).");
  if (m.missed) notes.push(`${fmt(m.missed)} score messages missed (the dashboard fell behind)`);
  if (m.tag_overflow_rows) notes.push(`${fmt(m.tag_overflow_rows)} rows of tags past the limit, counted under (other)`);
  status.textContent = notes.join("; ");
  status.hidden = !notes.length;
  const tbody = $("#monitors tbody"); tbody.replaceChildren();
  for (const [key, s] of series) (s.columns || []).forEach((c, i) => {
    const h = (scoreHistory[`${key}/${i}`] = scoreHistory[`${key}/${i}`] || []);
    if (c.recent_mean !== undefined) { h.push(c.recent_mean); if (h.length > HISTORY) h.shift(); }
    const tr = el("tr", { "data-series": key, "data-col": i }), ts = el("td");
    ts.append(line(h, 140, 32, "#8e44ad"));
    const num = (cls, v, digits) => el("td", { class: cls, "data-v": exact(v) }, fmt(v, digits));
    tr.append(el("td", {}, s.monitor), el("td", {}, `L${s.layer}.${s.hook}`), el("td", { class: "column" }, columnName(s, c, i)),
      num("version", s.version), el("td", { class: "rows", "data-v": exact(s.rows) }, fmt(s.rows) + (s.nonfinite_rows ? ` (+${fmt(s.nonfinite_rows)} non-finite)` : "")),
      num("mean", c.mean, 4), num("recent-mean", c.recent_mean, 4), num("p90", c.p90, 4), num("max", c.max, 4),
      el("td", { class: "above", "data-v": exact(c.above), title: `share of recent scores above ${s.threshold}` },
        c.above === undefined ? "-" : `${(100 * c.above).toFixed(1)} % > ${s.threshold}`), ts);
    tbody.append(tr);
  });
  const names = Object.fromEntries(series.map(([k, s]) => [k, (s.columns || []).map((c, i) => columnName(s, c, i))]));
  const tags = $("#monitor-tags tbody"); tags.replaceChildren();
  for (const [label, per] of Object.entries(m.tags || {})) for (const [key, v] of Object.entries(per)) (v.means || []).forEach((mean, i) => {
    const tr = el("tr", { "data-tag": label, "data-series": key, "data-col": i });
    tr.append(el("td", {}, label), el("td", {}, key), el("td", {}, (names[key] || [])[i] || `c${i}`),
      el("td", { class: "rows" }, fmt(v.rows)), el("td", { class: "mean", "data-v": exact(mean) }, fmt(mean, 4)));
    tags.append(tr);
  });
  const reqs = $("#monitor-requests"); reqs.replaceChildren();
  for (const r of m.requests || []) {
    const d = el("div", { class: "req", "data-request": r.request_id, "data-sample": r.sample_index });
    const tagText = Object.entries(r.tags || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    const head = el("div");
    head.append(el("span", { class: "id" }, r.request_id + (r.sample_index ? `#${r.sample_index}` : "")),
      el("span", { class: "muted" }, `${r.ended ? "  ended: " + r.ended : ""}${tagText ? ", " + tagText : ""}`));
    d.append(head);
    for (const [key, v] of Object.entries(r.series || {})) {
      const row = el("div", { class: "mseries" });
      row.append(el("span", { class: "muted" }, `${key} (${v.positions.length} tokens)`));
      (v.values || []).forEach((vals, j) => {
        const s = line(vals, Math.min(600, 4 * vals.length + 20), 28, "#8e44ad");
        for (const [k, x] of Object.entries({ "data-series": key, "data-col": j, "data-positions": v.positions.join(","), "data-values": vals.map(exact).join(",") })) s.setAttribute(k, x);
        const t = document.createElementNS(NS, "title");
        t.textContent = `${key} ${(names[key] || [])[j] || "c" + j}: positions ${v.positions[0]}..${v.positions.at(-1)}, last ${fmt(vals.at(-1), 4)}`;
        s.appendChild(t); row.append(s);
      });
      d.append(row);
    }
    reqs.append(d);
  }
}

function renderExperts(e) {
  // Expert load per layer (mixture-of-experts engines only: a dense model has no entry).
  $("#experts-section").hidden = !e;
  if (!e) return;
  const notes = [];
  if (e.error) notes.push(`expert load left out: ${e.error}`);
  else if (!Object.keys(e.layers || {}).length) notes.push("No router rows yet.");
  if (e.num_experts) notes.push(`${e.num_experts} experts, top ${e.top_k} per token`);
  if (e.missed) notes.push(`${fmt(e.missed)} messages missed (the dashboard fell behind)`);
  if (e.bad_rows) notes.push(`${fmt(e.bad_rows)} router rows refused (ids not in range, or not finite)`);
  $("#experts-status").textContent = notes.join("; ");
  const tbody = $("#experts tbody"); tbody.replaceChildren();
  for (const [layer, v] of Object.entries(e.layers || {})) {
    const tr = el("tr", { "data-layer": layer, "data-counts": v.counts.join(","), "data-weights": v.weights.join(",") });
    const load = el("td"), weight = el("td"), w = Math.min(640, 8 * v.counts.length + 20);
    load.append(bars(v.counts, w, 40, "#d35400", `L${layer}: tokens per expert 0..${v.counts.length - 1}`));
    weight.append(bars(v.weights, w, 40, "#16a085", `L${layer}: routing weight per expert 0..${v.weights.length - 1}`));
    tr.append(el("td", {}, `L${layer}`), el("td", { class: "tokens", "data-v": exact(v.tokens) }, fmt(v.tokens)),
      el("td", { class: "imbalance", "data-v": exact(v.imbalance) }, fmt(v.imbalance, 2)), load, weight);
    tbody.append(tr);
  }
}

function connect() {
  if (source) source.close();
  const q = tapWanted ? `?tap=${encodeURIComponent(tapWanted)}` : "";
  source = new EventSource("/events" + q);
  source.onopen = () => { $("#status").textContent = "live"; $("#status").className = "pill live"; };
  source.onerror = () => { $("#status").textContent = "reconnecting"; $("#status").className = "pill"; };
  source.onmessage = (e) => render(JSON.parse(e.data));
}
$("#tap").addEventListener("change", (e) => { tapWanted = e.target.value; connect(); });
connect();
