// tickserve dashboard: reads /scheduler/stats/stream (server-sent events) and draws
// each metric as a uPlot time series plus its current value. No other network use.
// The stream's first event, "history", holds the last minute (one point a second), so a
// page opened now starts with the minute before it.
"use strict";

const HISTORY_S = 60;             // seconds each chart shows: the last minute
const NO_SESSION = "(no session)";  // requests without a session id (one row, all engines)
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const CODES_429 = ["queue_full", "kv_budget", "block_pool"];
const FAIR_SERIES = 6;            // sessions drawn in the fairness chart

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 1) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(digits);
const ms = (s) => (s === null || s === undefined) ? "–" : (s * 1000).toFixed(1) + " ms";
const pct = (v) => (v === null || v === undefined) ? "–" : (v * 100).toFixed(1) + " %";

function chart(id, names, yLabel) {
  const el = $(id);
  const opts = {
    width: Math.max(300, el.clientWidth || 420), height: 170,
    legend: { live: false },
    // always the last HISTORY_S seconds, ending at the newest point (or now): one point
    // alone no longer stretches the axis over years
    scales: { x: { time: true, range: (u) => {
      const xs = u.data[0];
      const end = xs && xs.length ? xs[xs.length - 1] : Date.now() / 1000;
      return [end - HISTORY_S, end];
    } } },
    axes: [{}, { label: yLabel, size: 56 }],
    series: [{}].concat(names.map((n, i) => ({ label: n, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false }))),
  };
  const data = [[]].concat(names.map(() => []));
  return { plot: new uPlot(opts, data, el), data, names };
}

function push(c, t, values) {
  c.data[0].push(t);
  values.forEach((v, i) => c.data[i + 1].push(v === undefined ? null : v));
  while (c.data[0].length && c.data[0][0] < t - HISTORY_S) c.data.forEach((col) => col.shift());
  c.plot.setData(c.data);
}

const charts = {
  queues: chart("c-queues", ["waiting", "prefilling", "decoding", "batch size"], "requests"),
  kv: chart("c-kv", ["KV blocks in use", "KV tokens reserved of budget"], "%"),
  gates: chart("c-gates", ["held for KV room/s"].concat(CODES_429.map((c) => "429 " + c.replace("_", " ") + "/s")), "per s"),
  speed: chart("c-speed", ["output tokens/s"], "tokens/s"),
  latency: chart("c-latency", ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], "ms"),
};
let fair = null;                  // rebuilt when the set of drawn sessions changes
let fairSessions = [];

function fairChart(t, sessions) {
  // Series are keyed by session name, in the order sessions first appeared, so a
  // session's line keeps its colour and history; the chart is rebuilt only when a new
  // session enters the busiest set.
  const top = sessions.slice(0, FAIR_SERIES).map((s) => s.session || NO_SESSION);
  let names = fairSessions.filter((n) => top.includes(n) || fairSessions.length + top.length <= FAIR_SERIES);
  for (const n of top) if (!names.includes(n)) names.push(n);
  names = names.slice(0, FAIR_SERIES);
  if (!fair || names.join("\u0000") !== fairSessions.join("\u0000")) {
    if (fair) fair.plot.destroy();
    fair = chart("c-fair", names.length ? names : ["(no traffic)"], "tokens/s");
    fairSessions = names;
  }
  const rate = new Map(sessions.map((s) => [s.session || NO_SESSION, s.tokens_per_s]));
  push(fair, t, names.length ? names.map((n) => rate.get(n) || 0) : [null]);
}

const engines = new Map();        // engine id → last row data (one row per engine seen)
let updates = 0;

function renderEngines() {
  const body = document.querySelector("#engines tbody");
  body.textContent = "";
  for (const [id, e] of engines) {
    const tr = document.createElement("tr");
    tr.dataset.engine = id;
    const r = e.runtime || {};
    const h = e.handovers;
    const cells = [e.label || id, null, e.restarts, r.device, r.dtype, r.torch_threads, r.backend, r.prefill_mode,
                   r.role || "monolithic", r.policy, e.transport, e.num_frontends, e.num_ticks,
                   e.kv_pressure === undefined || e.kv_pressure === null ? null : fmt(e.kv_pressure, 2),
                   h && r.role && r.role !== "monolithic"
                     ? `${h.count} · ${fmt(h.time_p50_ms, 1)} / ${fmt(h.time_p99_ms, 1)} ms` : null];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      if (i === 1) {
        const b = document.createElement("span");
        b.className = "badge engine-state " + (e.up ? "up" : "down");
        b.textContent = e.up ? "up" : "down";
        td.appendChild(b);
      } else td.textContent = v === undefined || v === null ? "–" : String(v);
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
}

function renderSessions(sessions) {
  const body = document.querySelector("#sessions tbody");
  body.textContent = "";
  for (const s of sessions) {
    const tr = document.createElement("tr");
    [s.session || NO_SESSION, fmt(s.tokens_per_s), s.vtc_counter === null || s.vtc_counter === undefined ? "–" : fmt(s.vtc_counter, 0)]
      .forEach((v) => { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); });
    body.appendChild(tr);
  }
}

function plotStats(t, s) {
  // one point of every chart at time t (seconds) from a stats body, or a history point
  const w = s.window || {};
  push(charts.queues, t, [s.num_pending, s.num_prefilling, s.num_active, s.batch_size]);
  const reserved = s.kv_budget_tokens ? s.active_kv_reserved / s.kv_budget_tokens : null;
  push(charts.kv, t, [s.kv_pressure === null || s.kv_pressure === undefined ? null : s.kv_pressure * 100,
                      reserved === null ? null : reserved * 100]);
  const rej = w.rejects_per_s || {};
  push(charts.gates, t, [w.kv_admit_blocked_per_s].concat(CODES_429.map((c) => rej[c])));
  push(charts.speed, t, [w.output_tokens_per_s]);
  const toMs = (v) => (v === null || v === undefined) ? null : v * 1000;
  push(charts.latency, t, [toMs(w.ttft_p50_s), toMs(w.ttft_p99_s), toMs(w.itl_p50_s), toMs(w.itl_p99_s)]);
  fairChart(t, w.sessions || []);
}

function onHistory(h) {
  // the minute before this page: only on a fresh page (a reconnect keeps what it drew)
  if (charts.queues.data[0].length) return;
  const offset = Date.now() / 1000 - h.now;   // the server's clock → this page's
  for (const p of h.points || []) plotStats(p.t + offset, p);
}

function onStats(msg) {
  updates += 1;
  $("updates").textContent = updates;
  const t = Date.now() / 1000;
  const eng = msg.engine || {};
  const s = msg.stats;
  $("conn").textContent = eng.up ? "engine up" : "engine down";
  $("conn").className = "badge " + (eng.up ? "up" : "down");
  if (msg.engines) {               // several engines: one row each, by address
    for (const e of msg.engines) {
      const st = e.stats;
      const prev = engines.get(e.address) || {};
      engines.set(e.address, Object.assign(prev, {
        label: (e.engine_id || "–") + " @ " + e.address,
        up: !!e.up, restarts: e.restarts,
        transport: (msg.frontend || {}).transport,
        runtime: st ? st.runtime : prev.runtime,
        num_frontends: st ? st.num_frontends : prev.num_frontends,
        num_ticks: st ? st.num_ticks : prev.num_ticks,
        kv_pressure: st ? st.kv_pressure : prev.kv_pressure,
        handovers: st ? st.handovers : prev.handovers,
      }));
    }
  } else {
    for (const e of engines.values()) e.up = false;   // only the current engine can be up
    if (eng.engine_id || s) {
      const id = (s && s.engine_id) || eng.engine_id;
      const prev = engines.get(id) || {};
      engines.set(id, Object.assign(prev, {
        up: !!eng.up, restarts: eng.restarts,
        transport: (msg.frontend || {}).transport,
        runtime: s ? s.runtime : prev.runtime,
        num_frontends: s ? s.num_frontends : prev.num_frontends,
        num_ticks: s ? s.num_ticks : prev.num_ticks,
        kv_pressure: s ? s.kv_pressure : prev.kv_pressure,
        handovers: s ? s.handovers : prev.handovers,
      }));
    }
  }
  renderEngines();
  if (!s) {                       // engine down: gaps in every chart
    Object.values(charts).forEach((c) => push(c, t, c.names.map(() => null)));
    return;
  }
  const w = s.window || {};
  $("v-num_pending").textContent = s.num_pending;
  $("v-num_prefilling").textContent = s.num_prefilling;
  $("v-num_active").textContent = s.num_active;
  $("v-batch_size").textContent = s.batch_size;
  $("v-kv_pressure").textContent = pct(s.kv_pressure);
  $("v-active_kv_reserved").textContent = s.active_kv_reserved;
  $("v-kv_budget_tokens").textContent = s.kv_budget_tokens;
  const rej = w.rejects_per_s || {};
  const r429 = CODES_429.reduce((a, c) => a + (rej[c] || 0), 0);
  $("v-kv_admit_blocked_per_s").textContent = fmt(w.kv_admit_blocked_per_s);
  $("v-rejects_429_per_s").textContent = fmt(r429);
  $("v-rejects_by_reason").textContent = CODES_429.map((c) => c.replace("_", " ") + " " + fmt(rej[c])).join(", ");
  $("v-output_tokens_per_s").textContent = fmt(w.output_tokens_per_s);
  $("v-prefix_cache_hit_rate").textContent = pct(w.prefix_cache_hit_rate);
  $("v-ttft_p50").textContent = ms(w.ttft_p50_s);
  $("v-ttft_p99").textContent = ms(w.ttft_p99_s);
  $("v-itl_p50").textContent = ms(w.itl_p50_s);
  $("v-itl_p99").textContent = ms(w.itl_p99_s);
  renderSessions(w.sessions || []);
  plotStats(t, s);
}

function connect() {
  const key = new URLSearchParams(location.search).get("api_key");
  const url = "/scheduler/stats/stream" + (key ? "?api_key=" + encodeURIComponent(key) : "");
  const source = new EventSource(url);   // reconnects by itself (the stream sends retry: 1000)
  source.addEventListener("history", (ev) => onHistory(JSON.parse(ev.data)));
  source.addEventListener("stats", (ev) => onStats(JSON.parse(ev.data)));
  source.onerror = () => {
    $("conn").textContent = "frontend unreachable";
    $("conn").className = "badge down";
  };
}

connect();
