// The migration dashboard: reads the controller's server-sent events and draws them.
// Plain DOM and SVG, no framework and no build step. Every piece of data is put on the page
// with textContent (never innerHTML), so nothing a plan or an actor says can run as code.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let latest = null;

function token() { return sessionStorage.getItem("spine-admin-token") || ""; }
function authHeaders() { return token() ? { Authorization: "Bearer " + token() } : {}; }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child == null ? "" : child);
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}
const clock = (ts) => ts ? new Date(ts * 1000).toLocaleTimeString() : "-";
const num = (v, digits = 3) => v == null ? "-" : Number(v).toPrecision(digits);
const pct = (v) => v == null ? "-" : (100 * v).toFixed(2) + " %";

// --- live data: server-sent events read with fetch (so the token can go in a header) ------

async function follow() {
  for (;;) {
    try {
      const answer = await fetch("api/events", { headers: authHeaders(), cache: "no-store" });
      if (answer.status === 401) {
        const why = (await answer.json()).error;
        $("freshness").textContent = "viewing needs the admin token: " + why;
        await sleep(1000);
        continue;
      }
      const reader = answer.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (data) render(JSON.parse(data));
        }
      }
    } catch (error) {
      $("freshness").textContent = "disconnected (" + error.message + "); retrying";
    }
    await sleep(1000);
  }
}
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// --- drawing -------------------------------------------------------------------------------

function render(state) {
  latest = state;
  const s = state.status;
  document.body.dataset.state = s.state;
  document.body.dataset.stage = s.stage_name || "";
  $("plan-name").textContent = s.plan_name || "(no plan loaded)";
  $("state").textContent = s.state.replace("_", " ");
  $("freshness").textContent = "live, updated " + clock(state.now);
  renderTimeline(state.plan, s);
  renderTraffic(s);
  renderGates(state.gate_history.filter((p) => !p.gate.startsWith("judge.")));
  renderJudge(state.judge || []);
  renderLayouts(state.layouts, s);
  renderPlanes(s);
  renderAudit(s.recent_audit);
  renderRuns(state.runs || []);
}

// What the rollout moves traffic away from: a foreign gateway's name (the plan's `legacy`
// endpoint), else spine's own layered stack. A foreign gateway has no middlewares to move.
function fromSide(s) { return (s && s.from_side) || "layered"; }
function foreign(s) { return fromSide(s) !== "layered"; }

function renderTimeline(plan, s) {
  const list = $("timeline");
  list.replaceChildren();
  if (!plan) return;
  plan.stages.forEach((stage, index) => {
    const local = Object.entries(stage.placements).filter(([, where]) => where === "local").map(([name]) => name);
    let cls = "pending";
    if (s.state === "promoted" || index < s.stage_index) cls = "done";
    else if (index === s.stage_index && s.state !== "pending") cls = "current";
    else if (stage.name === s.awaiting_stage) cls = "awaiting";
    const item = el("li", { class: cls, "data-stage": stage.name },
      el("div", { class: "name" }, `${index + 1}. ${stage.name}`),
      el("div", { class: "detail" }, `spine ${stage.spine_weight}%` + (stage.manual_approval ? " · manual approval" : "")),
      el("div", { class: "detail" }, foreign(s) ? "the spine serves whole" : "local: " + (local.join(", ") || "none")),
      el("div", { class: "detail" }, (stage.hold_s != null ? `hold ${stage.hold_s}s · ` : "") +
        `${stage.gates.length} gate(s)`));
    if (cls === "current") item.setAttribute("aria-current", "step");
    list.append(item);
  });
}

function renderTraffic(s) {
  $("spine-bar").style.width = `${s.spine_weight}%`;
  $("weights-text").textContent = `spine ${s.spine_weight}% · ${fromSide(s)} ${s.layered_weight}%`;
  const local = Object.entries(s.placements).filter(([, w]) => w === "local").map(([n]) => n);
  const facts = [
    ["stage", s.stage_count ? `${s.stage_index + 1}/${s.stage_count} ${s.stage_name}` : "-"],
    ["from", foreign(s) ? `${fromSide(s)} (a foreign gateway; the spine serves whole)` : "layered"],
    foreign(s) ? null : ["collapsed", local.join(", ") || "none"],
    ["hold", `${Number(s.stage_elapsed_s).toFixed(0)}s` + (s.hold_s != null ? ` / ${s.hold_s}s` : "")],
    ["spine requests", String(s.stage_requests) + (s.min_requests != null ? ` / ${s.min_requests}` : "")],
    ["failing windows", `${s.consecutive_failures} (limit ${s.failure_limit})`],
    ["version", `${s.version || "-"} (${s.applied ? "applied" : "waiting for ACK"})`],
  ];
  if (s.awaiting_stage) facts.push(["awaiting", `approval to enter ${s.awaiting_stage}`]);
  if (s.leadership) {  // several controller replicas on one store: who leads, at which lease epoch
    const l = s.leadership;
    facts.push(["leader", l.leader ? `${l.leader}, epoch ${l.epoch}` + (l.leading ? " (this replica)" : ` (asked ${l.controller})`)
      : "none right now (election under way)"]);
  }
  $("facts").replaceChildren(...facts.filter(Boolean).flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

// One chart: lines of [x, y] points; `marks` are dots classed by verdict.
function chart(title, lines, marks) {
  const W = 420, H = 130, P = 28;
  const points = lines.flatMap((l) => l.points).concat(marks || []);
  const box = el("div", { class: "chart" }, el("h3", {}, title));
  const plot = svg("svg", { class: "plot", width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  box.append(plot);
  if (!points.length) { const t = svg("text", { x: P, y: H / 2 }); t.textContent = "no data yet"; plot.append(t); return box; }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const y0 = Math.min(0, ...ys), highest = Math.max(...ys), y1 = highest > y0 ? y0 + (highest - y0) * 1.1 : y0 + 1;
  const X = (x) => P + (W - P - 6) * (x - x0) / (x1 - x0);
  const Y = (y) => H - 16 - (H - 26) * (y - y0) / (y1 - y0);
  for (const line of lines) {
    if (!line.points.length) continue;
    plot.append(svg("polyline", { class: line.cls, points: line.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ") }));
  }
  for (const mark of marks || []) plot.append(svg("circle", { class: mark[2], cx: X(mark[0]), cy: Y(mark[1]), r: 3 }));
  const top = svg("text", { x: 2, y: 12 }); top.textContent = num(y1);
  const bottom = svg("text", { x: 2, y: H - 18 }); bottom.textContent = num(y0);
  const when = svg("text", { x: P, y: H - 3 }); when.textContent = `${clock(x0)} – ${clock(x1)}`;
  plot.append(top, bottom, when);
  return box;
}

function renderGates(history) {
  const byGate = new Map();
  for (const point of history) {
    if (!byGate.has(point.gate)) byGate.set(point.gate, []);
    byGate.get(point.gate).push(point);
  }
  const charts = [];
  for (const [gate, points] of byGate) {
    const measured = points.filter((p) => p.value != null);
    const last = points[points.length - 1];
    const title = `${gate}: ${num(last.value)} vs ${num(last.threshold)} (${last.verdict}${last.dry_run ? ", dry run" : ""})`;
    const node = chart(title, [
      { cls: "value", points: measured.map((p) => [p.window_end, p.value]) },
      { cls: "threshold", points: points.map((p) => [p.window_end, p.threshold]) },
    ], measured.map((p) => [p.window_end, p.value, p.verdict]));
    node.dataset.gate = gate;
    node.querySelector("h3").className = "verdict-" + last.verdict;
    charts.push(node);
  }
  $("gates").replaceChildren(...(charts.length ? charts : [el("p", { class: "muted" }, "no gate window judged yet")]));
}

// The judge's latest window: the score against its pass threshold, then each metric's verdict,
// effect against its margin, and the message that carries its confidence interval.
function renderJudge(points) {
  $("judge-section").hidden = !points.length;
  if (!points.length) return;
  const [score, ...metrics] = points;
  // The outcome in the judge's words ("marginal: score 80.0 < pass 90, ... (at 98% confidence)").
  const end = score.message.indexOf(" confidence)");
  const outcome = end >= 0 ? score.message.slice(0, end + " confidence)".length) : score.message;
  $("judge-score").textContent = outcome + (score.dry_run ? " · dry run" : "") +
    ` · stage ${score.stage}, window ending ${clock(score.window_end)}`;
  $("judge-score").className = "verdict-" + score.verdict;
  const head = el("tr", {}, ...["metric", "verdict", "effect", "margin", "detail"].map((h) => el("th", {}, h)));
  const rows = metrics.map((m) => el("tr", { class: "verdict-" + m.verdict, "data-metric": m.gate.slice(6) },
    el("td", {}, m.gate.slice(6)), el("td", {}, m.message.split(":")[0]), el("td", {}, num(m.value)),
    el("td", {}, num(m.threshold)), el("td", {}, m.message)));
  $("judge").replaceChildren(head, ...rows);
}

function renderLayouts(layouts, s) {
  $("layout-window").textContent = `(requests that ended in the last ${layouts.window_s} s)`;
  const head = el("tr", {}, ...["side", "p50 ms", "p99 ms", "error rate", "requests/s", ""].map((h) => el("th", {}, h)));
  const rows = ["layered", "spine"].map((side) => {
    const n = (layouts.latest || {})[side] || {};
    return el("tr", { "data-side": side }, el("td", {}, side === "layered" ? fromSide(s) : side), el("td", {}, num(n.p50_ms)), el("td", {}, num(n.p99_ms)),
      el("td", {}, pct(n.error_rate)), el("td", {}, num(n.rps)), el("td", { class: "muted" }, n.missing || ""));
  });
  $("layouts").replaceChildren(head, ...rows);
  const series = (side, key) => layouts.history.filter((h) => h[side][key] != null).map((h) => [h.ts, h[side][key]]);
  $("layout-charts").replaceChildren(...[["p99 ms", "p99_ms"], ["error rate", "error_rate"], ["requests/s", "rps"]]
    .map(([title, key]) => chart(`${title} (grey ${fromSide(s)}, purple spine)`,
      [{ cls: "layered", points: series("layered", key) }, { cls: "spine", points: series("spine", key) }])));
}

function renderPlanes(s) {
  const head = el("tr", {}, ...["node", "kind", "ACKed", "sent", "NACK"].map((h) => el("th", {}, h)));
  const current = (v) => v === s.version || (v || "").startsWith(s.version + "+m");
  const rows = s.data_planes.map((p) => el("tr", { class: current(p.acked_version) ? "acked" : "behind" },
    el("td", {}, p.node_id), el("td", {}, p.type), el("td", {}, (p.acked_version || "-") + (current(p.acked_version) ? " ✓" : "")),
    el("td", {}, p.sent_version || "-"), el("td", {}, p.nack_error ? `${p.nacked_version}: ${p.nack_error}` : "-")));
  const followers = s.followers.map((f) => el("tr", { class: current(f.acked_version) ? "acked" : "behind" },
    el("td", {}, f.node_id), el("td", {}, f.role), el("td", {}, (f.acked_version || "-") + (current(f.acked_version) ? " ✓" : "")),
    el("td", {}, f.sent_version || "-"), el("td", {}, f.nack_error ? `${f.nacked_version}: ${f.nack_error}` : "-")));
  const none = rows.length + followers.length ? [] :
    [el("tr", {}, el("td", { colspan: 5, class: "muted" }, `no xDS data plane connected; version ${s.version || "-"} ` +
      (s.applied ? "applied" : "waiting for ACK")))];
  $("planes").replaceChildren(head, ...rows, ...followers, ...none);
}

function renderAudit(rows) {
  const head = el("tr", {}, ...["time", "actor", "action", "from → to", "stage", "reason"].map((h) => el("th", {}, h)));
  const body = rows.slice().reverse().map((r) => el("tr", {}, el("td", {}, clock(r.ts)), el("td", {}, r.actor),
    el("td", {}, r.action), el("td", {}, `${r.from_state} → ${r.to_state}`), el("td", {}, r.stage), el("td", {}, r.reason)));
  $("audit").replaceChildren(head, ...body);
}

function renderRuns(runs) {
  const head = el("tr", {}, ...["#", "started", "run", "by", "outcome", "at stage", "why", "took"].map((h) => el("th", {}, h)));
  const took = (r) => r.ended_at ? `${(r.ended_at - r.started_at).toFixed(1)}s` : "running";
  const body = runs.map((r, i) => el("tr", { class: "run-" + r.state, "data-state": r.state },
    el("td", {}, String(i + 1)), el("td", {}, clock(r.started_at)), el("td", {}, r.title), el("td", {}, r.actor),
    el("td", { class: "outcome" }, r.state.replace("_", " ")), el("td", {}, r.stage), el("td", {}, r.why), el("td", {}, took(r))));
  const none = runs.length ? [] : [el("tr", {}, el("td", { colspan: 8, class: "muted" }, "no rollout started yet"))];
  $("runs").replaceChildren(head, ...body, ...none);
}

// --- the operator's buttons: the controller decides, the page only reports ----------------

async function command(name) {
  const s = latest ? latest.status : null;
  let stage = "";
  if (name === "advance" && s && s.stage_index + 1 < s.stage_names.length) stage = s.stage_names[s.stage_index + 1];
  if (name === "approve" && s) stage = s.awaiting_stage || "";
  const result = $("command-result");
  result.className = "";
  result.textContent = `${name}…`;
  try {
    const answer = await fetch("api/commands/" + name, {
      method: "POST", cache: "no-store",
      headers: Object.assign({ "Content-Type": "application/json" }, authHeaders()),
      body: JSON.stringify({ actor: $("actor").value, reason: $("reason").value, stage }),
    });
    const reply = await answer.json();
    if (answer.ok) {
      result.className = "ok";
      result.textContent = `${name}: done by ${reply.actor}`;
      render(reply.state);
    } else {
      result.className = "refused";
      result.textContent = `${name} refused (${answer.status}): ${reply.error}`;
    }
  } catch (error) {
    result.className = "refused";
    result.textContent = `${name} failed: ${error.message}`;
  }
}

// A link printed by `spine migrate status`, the controller or the demo carries the admin token
// in its fragment (#token=...), which a browser never sends to a server: kept for this tab,
// then taken out of the address bar (and so out of history and bookmarks).
function tokenFromFragment() {
  const fragment = new URLSearchParams(location.hash.slice(1));
  const given = (fragment.get("token") || "").trim();
  if (!given) return;
  sessionStorage.setItem("spine-admin-token", given);
  fragment.delete("token");
  const rest = fragment.toString();
  history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
}

document.addEventListener("DOMContentLoaded", () => {
  tokenFromFragment();
  $("token").value = token();
  $("token").addEventListener("input", () => sessionStorage.setItem("spine-admin-token", $("token").value.trim()));
  for (const button of document.querySelectorAll("button[data-command]")) {
    button.addEventListener("click", () => command(button.dataset.command));
  }
  follow();
});
