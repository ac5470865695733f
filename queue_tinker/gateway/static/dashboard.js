// queue_tinker dashboard: polls the gateway's /api/v1/dashboard/* every 2 s and renders tables,
// an inline-SVG loss curve and the fleet's history. Plain JS, no build step, nothing loaded from
// elsewhere.
// Every value from the server goes into the page as text (textContent), never as HTML.
"use strict";

const API = "api/v1/dashboard";
const KEY_STORE = "qt-dashboard-key";
const POLL_MS = 2000;
const OP_KINDS = ["create_model", "ping", "forward", "forward_backward", "optim_step",
  "save_state", "save_weights_for_sampler", "load_state", "unload_model", "sample",
  "create_sampling_session", "save_weights_external"];

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  caller: null,
  selectedRun: null,   // run id whose loss curve and checkpoints are shown
  userPicked: false,   // false: follow the most recently active run
  paused: false,
  inFlight: false,
  timer: null,
  generation: 0,       // bumped on every sign-in/out: answers for an older key are dropped
  historyDue: 0,       // when (Date.now()) to ask for the fleet's history again
};

const $ = (id) => document.getElementById(id);

// --- formatting ------------------------------------------------------------------------------

function fmtAge(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} m ${Math.round(seconds % 60)} s`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function fmtBytes(n) {
  if (n === null || n === undefined || n === "") return "–";
  n = Number(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

function fmtTime(epoch) {
  if (!epoch) return "–";
  const d = new Date(epoch * 1000);
  const today = new Date();
  const time = d.toLocaleTimeString([], { hour12: false });
  return d.toDateString() === today.toDateString() ? time : `${d.toLocaleDateString()} ${time}`;
}

function fmtLoss(x) {
  if (x === null || x === undefined) return "–";
  if (typeof x === "string") return x;  // "NaN", "Infinity", "-Infinity": a diverging step
  const a = Math.abs(x);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(3) : x.toPrecision(5);
}

function fmtLimit(used, limit) {
  return limit ? `${used} / ${limit}` : `${used} / ∞`;
}

// --- DOM helpers -----------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function td(content, cls) {
  return el("td", { class: cls }, content);
}

function badge(text, kind) {
  return el("span", { class: `badge b-${kind || text}`, text });
}

function short(id, keep = 18) {
  return id && id.length > keep ? `${id.slice(0, keep)}…` : id || "–";
}

function idCell(id, keep) {
  return el("td", { class: "id", title: id || "" }, short(id, keep));
}

// Replace a table's rows; show the card's "empty" note when there are none.
function fillTable(tableId, rows) {
  const table = $(tableId);
  table.tBodies[0].replaceChildren(...rows);
  const empty = table.closest(".card").querySelector(".empty");
  if (empty) empty.hidden = rows.length > 0;
}

// --- talking to the gateway ------------------------------------------------------------------

class AuthError extends Error {}

async function api(path, options = {}) {
  const response = await fetch(`${API}/${path}`, {
    ...options,
    headers: { "X-API-Key": state.key, ...(options.headers || {}) },
    cache: "no-store",
  });
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (response.status === 401) throw new AuthError((body && body.detail) || "not authorized");
  if (!response.ok) {
    const detail = body && body.detail;
    throw new Error(typeof detail === "string" ? detail : `HTTP ${response.status}`);
  }
  return body;
}

function showBanner(message, ok = false) {
  const banner = $("banner");
  banner.textContent = message;
  banner.className = ok ? "banner ok" : "banner";
  banner.hidden = !message;
}

// --- rendering -------------------------------------------------------------------------------

function renderQueues(queues) {
  $("queues-count").textContent = queues.length;
  fillTable("queues", queues.map((q) => {
    const st = badge(q.state, q.state);
    if (q.reason) st.title = q.reason;
    return el("tr", { "data-model-id": q.model_id },
      idCell(q.model_id, 22), td(st), td(q.tenant_id), td(q.kind), td(q.depth, "num"),
      td(fmtAge(q.oldest_wait_s), "num"), idCell(q.owner || "–", 14), td(q.base_model));
  }));
}

function renderTenants(tenants) {
  fillTable("tenants", tenants.map((t) => {
    const lim = t.limits || {};
    const tokens = lim.tokens_per_s
      ? `${t.tokens_level === null || t.tokens_level === undefined ? "–"
        : Math.round(t.tokens_level)} (${lim.tokens_per_s}/s)`
      : "unlimited";
    const paused = (t.paused_models || []).length
      ? el("span", {}, ...t.paused_models.map((m) => el("span", { class: "tag", text: m })))
      : badge("none", "ok");
    return el("tr", { "data-tenant-id": t.tenant_id },
      td(t.tenant_id), td(fmtLimit(t.training_runs, lim.training_runs), "num"),
      td(fmtLimit(t.inflight_ops, lim.inflight_ops), "num"), td(tokens, "num"),
      el("td", { class: "tags" }, paused));
  }));
}

function renderDeadLetters(dead) {
  const count = (dead && dead.count) || 0;
  $("dead-card").hidden = count === 0;
  $("dead-count").textContent = count;
  fillTable("dead", ((dead && dead.recent) || []).map((d) =>
    el("tr", { "data-entry": d.entry },
      td(d.type), idCell(d.id, 26), td(d.tenant_id || "–"), td(d.reason))));
}

function heartbeatBadge(age) {
  const kind = age < 5 ? "ok" : age < 15 ? "warn" : "bad";
  return badge(fmtAge(age), kind);
}

function currentOp(w) {
  if (!w.current_op) return el("span", { class: "muted", text: "idle" });
  const [kind, job] = w.current_op.split(":");
  if (w.current_op_hidden) return el("span", {}, kind, el("span", { class: "muted", text: " · another tenant" }));
  return el("span", { title: job }, kind, el("span", { class: "muted mono", text: ` ${short(job, 10)}` }));
}

function renderWorkers(workers) {
  $("workers-count").textContent = workers.length;
  const admin = state.caller && state.caller.admin;
  fillTable("workers", workers.map((w) => {
    const resident = el("td", { class: "tags" },
      ...(w.resident || []).map((m) => el("span", { class: "tag", title: m, text: short(m, 22) })));
    if (w.resident_hidden) {
      resident.append(el("span", { class: "muted small", text: `+${w.resident_hidden} of other tenants` }));
    }
    if (!resident.childNodes.length) resident.append(el("span", { class: "muted", text: "none" }));
    const stopping = w.stopping === true || w.stopping === "1" || w.stopping === 1;
    const drain = admin && !stopping
      ? el("button", { class: "act danger", text: "Drain", onclick: () => drainWorker(w.id) })
      : null;
    return el("tr", { "data-worker-id": w.id },
      idCell(w.id, 22), td(w.base_model), td(w.device), td(`${w.host || "?"} / ${w.pid || "?"}`),
      el("td", { class: "num" }, heartbeatBadge(Number(w.heartbeat_age_s || 0))),
      td(fmtBytes(w.memory_bytes), "num"), resident, td(currentOp(w)),
      td(w.ops_done, "num"), td(stopping ? badge("stopping", "stopping") : badge("serving", "ok")),
      td(drain));
  }));
}

function renderRuns(runs) {
  $("runs-count").textContent = runs.length;
  if (!state.userPicked || !runs.some((r) => r.id === state.selectedRun)) {
    state.selectedRun = runs.length ? runs[0].id : null;   // the most recently active one
    if (!runs.length) state.userPicked = false;
  }
  fillTable("runs", runs.map((r) => el("tr", {
    "data-run-id": r.id,
    class: r.id === state.selectedRun ? "selected" : "",
    onclick: () => { state.selectedRun = r.id; state.userPicked = true; refresh(); },
  },
  idCell(r.id, 24), td(r.tenant_id), td(r.base_model), td(r.rank ?? "–", "num"),
  td(r.steps, "num"), td(fmtLoss(r.last_loss), "num"), td(r.pending, "num"),
  td(r.failed ? badge(String(r.failed), "failed") : "0", "num"),
  td(fmtTime(r.created_at)), td(fmtTime(r.last_request_at || r.created_at)))));
}

function renderCheckpoints(rows) {
  $("checkpoints-scope").textContent = state.selectedRun ? `of ${state.selectedRun}` : "all runs";
  $("checkpoints-all").hidden = !state.userPicked;
  fillTable("checkpoints", rows.map((c) => el("tr", { "data-path": c.tinker_path },
    el("td", { class: "id", title: c.tinker_path }, c.checkpoint_id), idCell(c.run_id, 24),
    td(badge(c.kind, c.kind === "state" ? "info" : "ok")), td(fmtBytes(c.size_bytes), "num"),
    td(fmtTime(c.created_at)), td(c.expires_at ? fmtTime(c.expires_at) : "never"))));
}

function requestActions(r) {
  const cell = el("td");
  if (r.has_detail || r.error) {
    cell.append(el("button", { class: "act ghost", text: r.has_detail ? "traceback" : "details",
      onclick: () => openDetail(r.id) }));
  }
  if (r.status === "failed") {
    cell.append(el("button", { class: "act", text: "Retry", onclick: () => retryRequest(r.id) }));
  }
  // A running sample stops at its worker's next decode step; other running ops cannot stop.
  if (r.status === "queued" || (r.status === "running" && r.kind === "sample")) {
    cell.append(el("button", { class: "act danger", text: "Cancel", onclick: () => cancelRequest(r.id) }));
  }
  return cell;
}

function renderRequests(rows) {
  fillTable("requests", rows.map((r) => el("tr", { "data-request-id": r.id },
    td(fmtTime(r.queued_at)), idCell(r.id, 14), idCell(r.model_id, 20), td(r.seq, "num"),
    td(r.kind), td(badge(r.status)), td(fmtAge(r.latency_s), "num"), td(fmtAge(r.run_s), "num"),
    idCell(r.worker_id || "–", 14),
    el("td", { class: "err", title: r.error || "" }, r.error ? short(r.error, 90) : ""),
    requestActions(r))));
}

// --- the loss curve (inline SVG) -------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// About `count` round tick values covering [lo, hi] (whole numbers only, if `integer`).
function niceTicks(lo, hi, count, integer = false) {
  if (hi === lo) { hi = lo + 1; lo -= integer ? 0 : 1; }
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(v);
  return ticks;
}

function renderLoss(body) {
  const chart = $("loss-chart");
  const all = (body && body.points) || [];
  const last = all.length ? ` · last ${fmtLoss(all[all.length - 1].loss)}` : "";
  // A diverged loss travels as "NaN" / "Infinity": named in the title, left off the plot.
  const points = all.filter((p) => typeof p.loss === "number");
  $("loss-run").textContent = body
    ? `${body.run_id} · ${body.metric} per forward_backward${last}` : "";
  $("loss-empty").hidden = points.length > 0;
  $("loss-empty").textContent = body ? "No losses recorded yet." : "Pick a training run.";
  if (!points.length) { chart.replaceChildren(); return; }

  const W = 640, H = 280, L = 58, R = 16, T = 14, B = 38;
  // x: the optimizer step before which each loss was computed; fall back to the point's
  // position when a run has no optim_step (every point would share x = 0).
  const useStep = points[points.length - 1].step > points[0].step;
  const xs = points.map((p, i) => (useStep ? p.step : i + 1));
  const ys = points.map((p) => p.loss);
  const xTicks = niceTicks(Math.min(...xs), Math.max(...xs), 6, true);
  const yTicks = niceTicks(Math.min(...ys), Math.max(...ys), 5);
  const x0 = Math.min(xTicks[0], ...xs), x1 = Math.max(xTicks[xTicks.length - 1], ...xs);
  const y0 = Math.min(yTicks[0], ...ys), y1 = Math.max(yTicks[yTicks.length - 1], ...ys);
  const sx = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0 || 1)) * (H - T - B);

  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, id: "loss-svg", role: "img",
    "aria-label": `loss curve of ${body.run_id}` });
  const yStep = yTicks.length > 1 ? yTicks[1] - yTicks[0] : 1;
  const yDigits = Math.max(0, -Math.floor(Math.log10(yStep)) + (yStep % 1 ? 1 : 0));
  for (const v of yTicks) {
    root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: sy(v), y2: sy(v) }));
    root.append(svg("text", { class: "tick", x: L - 6, y: sy(v) + 4, "text-anchor": "end" },
      Math.abs(v) >= 1e5 ? v.toExponential(1) : v.toFixed(Math.min(yDigits, 6))));
  }
  for (const v of xTicks) {
    root.append(svg("line", { class: "grid", x1: sx(v), x2: sx(v), y1: T, y2: H - B }));
    root.append(svg("text", { class: "tick", x: sx(v), y: H - B + 16, "text-anchor": "middle" },
      String(Math.round(v * 100) / 100)));
  }
  root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  root.append(svg("text", { class: "label", x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" },
    useStep ? "optimizer step" : "forward_backward #"));

  const coords = xs.map((x, i) => [sx(x).toFixed(1), sy(ys[i]).toFixed(1)]);
  const line = coords.map(([x, y], i) => `${i ? "L" : "M"}${x},${y}`).join(" ");
  const area = `${line} L${coords[coords.length - 1][0]},${H - B} L${coords[0][0]},${H - B} Z`;
  root.append(svg("path", { class: "loss-area", d: area }));
  root.append(svg("path", { class: "loss-line", d: line, "data-points": points.length }));
  if (points.length <= 120) {
    points.forEach((p, i) => {
      const dot = svg("circle", { class: "loss-dot", cx: coords[i][0], cy: coords[i][1], r: 2.5 });
      dot.append(svg("title", {}, `step ${p.step} · seq ${p.seq} · loss ${fmtLoss(p.loss)}`));
      root.append(dot);
    });
  }
  chart.replaceChildren(root);
}

// --- the fleet's history (inline SVG, one line per base model) --------------------------------

const SERIES_CLASSES = 8;  // dashboard.css colours .c0 ... .c7; more base models reuse them
// Steps of the time axis, in seconds: the first that gives at most 5 ticks is used.
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600];
const HISTORY_CHARTS = {
  depth: { format: (v) => String(Math.round(v)), integer: true },
  oldest_wait_s: { format: (v) => fmtSpan(v), integer: false },
  // Whole-number ticks: a fraction of a token per second is noise on this axis.
  tokens_per_s: { format: (v) => (v >= 1e4 ? `${(v / 1e3).toFixed(0)}k` : String(Math.round(v))),
    integer: true },
  workers: { format: (v) => String(Math.round(v)), integer: true },
};

function fmtSpan(seconds) {
  if (seconds === 0) return "0";
  if (seconds < 60) return `${+seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${+(seconds / 60).toFixed(1)} m`;
  return `${+(seconds / 3600).toFixed(1)} h`;
}

function fmtClock(epoch, withSeconds) {
  const d = new Date(epoch * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  const hm = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
  return withSeconds ? `${hm}:${pad(d.getSeconds())}` : hm;
}

// An SVG path through the points, broken where a value is unknown (null).
function seriesPath(ts, vs, sx, sy) {
  let d = "", drawn = 0, pen = "M", lastT = null;
  ts.forEach((t, i) => {
    if (vs[i] === null || vs[i] === undefined) { pen = "M"; return; }
    d += `${pen}${sx(t).toFixed(1)},${sy(vs[i]).toFixed(1)} `;
    pen = "L";
    drawn += 1;
    lastT = t;
  });
  return { d: d.trim(), drawn, lastT };
}

// One time chart: `series` is [{name, colour, t: [...], v: [...]}], the x axis from t0 to t1.
function renderTimeChart(container, name, series, t0, t1, spec) {
  // About the width a chart gets four to a row on a 1500 px page: its text stays 10-11 px.
  const W = 360, H = 170, L = 46, R = 10, T = 10, B = 24;
  const values = series.flatMap((s) => s.v.filter((v) => v !== null && v !== undefined));
  const yTicks = niceTicks(0, Math.max(1, ...values), 4, spec.integer);
  const y1 = Math.max(yTicks[yTicks.length - 1], ...values, 1);
  const sx = (t) => L + ((t - t0) / (t1 - t0 || 1)) * (W - L - R);
  const sy = (v) => T + (1 - v / y1) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, id: `history-svg-${name}`, role: "img",
    "aria-label": `${name} over time` });
  for (const v of yTicks) {
    root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: sy(v), y2: sy(v) }));
    root.append(svg("text", { class: "tick", x: L - 5, y: sy(v) + 4, "text-anchor": "end" },
      spec.format(v)));
  }
  const step = TIME_STEPS.find((s) => (t1 - t0) / s <= 5) || TIME_STEPS[TIME_STEPS.length - 1];
  const halfLabel = step < 60 ? 24 : 15;  // half a label's width: HH:MM:SS or HH:MM
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
    root.append(svg("line", { class: "grid", x1: sx(t), x2: sx(t), y1: T, y2: H - B }));
    if (sx(t) + halfLabel > W) continue;  // its label would be cut off at the right edge
    root.append(svg("text", { class: "tick", x: sx(t), y: H - B + 15, "text-anchor": "middle" },
      fmtClock(t, step < 60)));
  }
  root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  for (const s of series) {
    const { d, drawn, lastT } = seriesPath(s.t, s.v, sx, sy);
    const line = svg("path", { class: `series ${s.colour}`, d, "data-series": s.name,
      "data-points": drawn, "data-last-t": lastT ?? "" });
    const last = [...s.v].reverse().find((v) => v !== null && v !== undefined);
    line.append(svg("title", {}, `${s.name}: ${last === undefined ? "–" : spec.format(last)} now`));
    root.append(line);
  }
  container.replaceChildren(root);
}

function renderHistory(body) {
  const bases = body.base_models || [];
  const fleet = body.fleet || { t: [], tokens_per_s: [] };
  const times = [...fleet.t, ...bases.flatMap((b) => b.t)];
  const empty = $("history-empty");
  $("history-span").textContent = body.interval_s
    ? `a sample every ${body.interval_s} s, kept ${fmtAge(body.retention_s)}` : "";
  empty.hidden = times.length > 0;
  empty.textContent = body.interval_s
    ? `No samples yet: the gateways take one every ${body.interval_s} s.`
    : "No history: the gateways sample none (QT_HISTORY_INTERVAL_S=0).";
  const colour = Object.fromEntries(bases.map((b, i) => [b.base_model, `c${i % SERIES_CLASSES}`]));
  $("history-legend").replaceChildren(...bases.map((b) => el("span", { class: "legend-item" },
    el("span", { class: `swatch ${colour[b.base_model]}` }), b.base_model)));
  const t0 = Math.min(...times), t1 = Math.max(body.now || 0, ...times);
  for (const [name, spec] of Object.entries(HISTORY_CHARTS)) {
    const chart = $(`history-${name}`);
    if (!times.length) { chart.replaceChildren(); continue; }
    const series = name === "tokens_per_s"
      ? [{ name: "fleet", colour: "fleet", t: fleet.t, v: fleet.tokens_per_s }]
      : bases.map((b) => ({ name: b.base_model, colour: colour[b.base_model], t: b.t, v: b[name] }));
    renderTimeChart(chart, name, series, t0, t1, spec);
  }
}

// --- the request detail (traceback one click away) -------------------------------------------

async function openDetail(requestId) {
  let r;
  try { r = await api(`requests/${encodeURIComponent(requestId)}`); } catch (e) {
    showBanner(`request ${requestId}: ${e.message}`); return;
  }
  $("detail-title").textContent = r.id;
  const fields = [["model", r.model_id], ["tenant", r.tenant_id], ["seq", r.seq],
    ["kind", r.kind], ["status", r.status], ["worker", r.worker_id || "–"],
    ["attempts", r.attempts], ["queued", fmtTime(r.queued_at)],
    ["started", fmtTime(r.started_at)], ["finished", fmtTime(r.finished_at)],
    ["latency", fmtAge(r.latency_s)], ["category", r.error_category || "–"]];
  $("detail-fields").replaceChildren(...fields.flatMap(([k, v]) =>
    [el("dt", { text: k }), el("dd", { text: String(v ?? "–") })]));
  $("detail-error").textContent = r.error || "no error";
  $("detail-trace").textContent = r.error_detail || "(no traceback: a user error, or none recorded)";
  $("detail-metrics").textContent = r.metrics ? JSON.stringify(r.metrics, null, 2) : "–";
  $("detail").showModal();
}

// --- actions ---------------------------------------------------------------------------------

async function act(path, done) {
  try {
    const body = await api(path, { method: "POST" });
    showBanner(done(body), true);
  } catch (e) {
    if (e instanceof AuthError) { signOut(e.message); return; }
    showBanner(e.message);
  }
  refresh();
}

function retryRequest(id) {
  act(`requests/${encodeURIComponent(id)}/retry`,
    (b) => `request ${id} queued again as ${b.retry_request_id}`);
}

function cancelRequest(id) {
  act(`requests/${encodeURIComponent(id)}/cancel`, () => `request ${id} cancelled`);
}

function drainWorker(id) {
  if (!window.confirm(`Drain worker ${id}? It finishes its current op, hands its models to other workers and exits.`)) return;
  act(`workers/${encodeURIComponent(id)}/drain`, () => `worker ${id} is draining`);
}

// --- the refresh loop ------------------------------------------------------------------------

function requestQuery() {
  const params = new URLSearchParams({ limit: "50" });
  for (const [name, id] of [["status", "filter-status"], ["kind", "filter-kind"], ["model", "filter-model"]]) {
    const value = $(id).value.trim();
    if (value) params.set(name, value);
  }
  return params.toString();
}

async function refresh() {
  if (!state.key || state.inFlight) return;
  state.inFlight = true;
  const generation = state.generation;
  try {
    const [overview, runs, requests] = await Promise.all([
      api("overview"), api("runs?limit=50"), api(`requests?${requestQuery()}`)]);
    if (generation !== state.generation) return;
    state.caller = overview.caller;
    const who = overview.caller;
    $("who").textContent = `tenant ${who.tenant_id}${who.admin ? " · admin (all tenants)" : ""}`;
    renderQueues(overview.queues || []);
    renderTenants(overview.tenants || []);
    renderWorkers(overview.workers || []);
    renderDeadLetters(overview.dead_letters);
    renderRuns(runs.runs || []);
    renderRequests(requests.requests || []);
    const run = state.selectedRun;
    const [loss, checkpoints] = await Promise.all([
      run ? api(`runs/${encodeURIComponent(run)}/loss`) : Promise.resolve(null),
      api(`checkpoints?limit=100${state.userPicked && run ? `&run=${encodeURIComponent(run)}` : ""}`),
    ]);
    if (generation !== state.generation) return;
    renderLoss(loss);
    renderCheckpoints(checkpoints.checkpoints || []);
    // The history changes once a sample interval: asked for no more often than that.
    if (Date.now() >= state.historyDue) {
      const history = await api("history");
      if (generation !== state.generation) return;
      renderHistory(history);
      state.historyDue = Date.now() + Math.max(POLL_MS, (history.interval_s || 60) * 1000);
    }
    $("updated").textContent = `updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
    $("live").className = state.paused ? "live paused" : "live";
  } catch (e) {
    if (generation !== state.generation) return;
    if (e instanceof AuthError) { signOut(e.message); return; }
    $("live").className = "live stale";
    $("updated").textContent = `refresh failed: ${e.message}`;
  } finally {
    if (generation === state.generation) state.inFlight = false;
  }
}

function startPolling() {
  clearInterval(state.timer);
  state.timer = setInterval(() => { if (!state.paused) refresh(); }, POLL_MS);
  refresh();
}

function showSignedIn(signedIn) {
  $("app").hidden = !signedIn;
  $("login").hidden = signedIn;
  for (const id of ["live", "pause", "change-key"]) $(id).hidden = !signedIn;
  $("who").textContent = "";
  $("updated").textContent = "";
}

function signOut(message) {
  clearInterval(state.timer);
  state.generation += 1;
  state.key = "";
  sessionStorage.removeItem(KEY_STORE);
  showSignedIn(false);
  $("key-input").value = "";
  $("key-error").textContent = message || "";
  $("key-error").hidden = !message;
  $("key-input").focus();
}

function signIn(key) {
  state.generation += 1;
  state.inFlight = false;  // a refresh for the old key may still be out: let a new one start
  state.key = key;
  state.caller = null;
  state.selectedRun = null;  // another key may not see the run picked before
  state.userPicked = false;
  state.historyDue = 0;
  sessionStorage.setItem(KEY_STORE, key);
  showSignedIn(true);
  startPolling();
}

document.addEventListener("DOMContentLoaded", () => {
  for (const kind of OP_KINDS) $("filter-kind").append(el("option", { text: kind }));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (key) signIn(key);
  });
  $("change-key").addEventListener("click", () => signOut(""));
  $("pause").addEventListener("click", () => {
    state.paused = !state.paused;
    $("pause").textContent = state.paused ? "Resume" : "Pause";
    $("live").className = state.paused ? "live paused" : "live";
  });
  $("filters").addEventListener("submit", (event) => event.preventDefault());
  for (const id of ["filter-status", "filter-kind"]) $(id).addEventListener("change", refresh);
  $("filter-model").addEventListener("input", refresh);
  $("filter-clear").addEventListener("click", () => {
    for (const id of ["filter-status", "filter-kind", "filter-model"]) $(id).value = "";
    refresh();
  });
  $("checkpoints-all").addEventListener("click", () => { state.userPicked = false; refresh(); });
  if (state.key) signIn(state.key); else signOut("");
});
