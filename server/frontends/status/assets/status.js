// Pier's status page: polls /api/status (same origin, the browser's credentials) and redraws.
"use strict";
const $ = (sel) => document.querySelector(sel);
const fmt = (v, unit, digits = 1) => (v === null || v === undefined) ? "–" : `${Number(v).toFixed(digits)}${unit}`;
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));

function spark(values, colour) {
  const pts = (values || []).map((v, i) => [i, v]).filter(([, v]) => v !== null);
  if (pts.length < 2) return '<svg class="spark"></svg>';
  const n = values.length - 1, max = Math.max(...pts.map(([, v]) => v), 1e-9);
  const line = pts.map(([i, v]) => `${(i / n * 140).toFixed(1)},${(27 - v / max * 25).toFixed(1)}`).join(" ");
  return `<svg class="spark" viewBox="0 0 140 28"><polyline stroke="${colour}" points="${line}"/></svg>`;
}
// The headline figures: a rate averaged over the last 10 s (5 points); a latency, the latest interval
// that had requests (an idle interval has none to measure).
const seen = (xs) => (xs || []).filter((v) => v !== null && v !== undefined);
const recent = (xs) => { const v = seen((xs || []).slice(-5)); return v.length ? v.reduce((a, b) => a + b) / v.length : null; };
const last = (xs) => { const v = seen(xs); return v.length ? v[v.length - 1] : null; };

function uptime(s) {
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
  return (d ? `${d}d ` : "") + (h ? `${h}h ` : "") + `${m}m ${Math.floor(s % 60)}s`;
}

function row(m) {
  const st = m.stats, ex = m.execution, sr = st ? st.series : null;
  const cells = [
    `<td>${esc(m.name)}</td>`,
    `<td>${esc(m.version ?? "–")}</td>`,
    `<td><span class="state ${esc(m.state).replace(/ /g, "_")}">${esc(m.state)}</span>` +
      (m.reason ? `<div class="reason">${esc(m.reason)}</div>` : "") + "</td>",
    `<td class="figure">${m.traffic_percent === undefined || m.traffic_percent === null ? "–" : m.traffic_percent + " %"}</td>`,
    `<td class="figure">${st ? `${st.queue} / ${st.in_flight}` : "–"}</td>`,
    `<td class="figure">${sr ? fmt(recent(sr.requests_per_s), "") + spark(sr.requests_per_s, "#2b6cb0") : "–"}</td>`,
    `<td class="figure">${sr ? `${fmt(last(sr.p50_ms), " ms")} / ${fmt(last(sr.p99_ms), " ms")}` +
      spark(sr.p99_ms, "#c05621") : "–"}</td>`,
    `<td>${ex ? ex.instances.map((g) => `${g.count}× ${esc(g.kind)}`).join(", ") +
      `<div class="reason">${esc(ex.backend)}, ${esc(ex.scheduler)}; ${esc(ex.mode)}</div>` : "–"}</td>`,
  ];
  const llm = st && st.llm;
  cells.push(llm ? `<td class="figure">KV cache ${fmt(100 * (llm.kv_cache_usage || 0), " %")}<br>` +
    `running ${llm.running ?? "–"}, waiting ${llm.waiting ?? "–"}<br>` +
    `${fmt(recent(sr.tokens_per_s), " tok/s")}${spark(sr.tokens_per_s, "#2f855a")}` +
    `TTFT p50 ${fmt(last(sr.ttft_p50_ms), " ms")}<br>prefix hits ${fmt(
      last(sr.prefix_hit_rate) === null ? null : 100 * last(sr.prefix_hit_rate), " %")}<br>` +
    `adapters: ${llm.adapters.length ? llm.adapters.map(esc).join(", ") : "none"}</td>` : "<td>–</td>");
  return `<tr data-model="${esc(m.name)}" data-state="${esc(m.state)}">${cells.join("")}</tr>`;
}

function render(doc) {
  const s = doc.server;
  $("#server").textContent = s ? `${s.name} ${s.version} · up ${uptime(s.uptime_s)} · ` +
    (s.exiting ? "exiting" : s.ready ? "ready" : "not ready") : "";
  if (s) $("#settings").textContent = JSON.stringify(s.settings, null, 2);
  const notice = doc.withheld.length ? `Not shown (restricted APIs, send their headers): ${doc.withheld.join(", ")}` : "";
  $("#notice").hidden = !notice;
  $("#notice").textContent = notice;
  const models = doc.models || [];
  $("#models tbody").innerHTML = models.length ? models.map(row).join("")
    : '<tr><td colspan="9" class="muted">no models</td></tr>';
  const llms = models.filter((m) => m.state === "READY" && m.stats && m.stats.llm).map((m) => m.name);
  const select = $("#playground select");
  if (select.dataset.models !== llms.join()) {
    select.dataset.models = llms.join();
    select.innerHTML = llms.map((n) => `<option>${esc(n)}</option>`).join("");
  }
  $("#playground").hidden = !llms.length;
}

async function poll() {
  let wait = 2000;
  try {
    const reply = await fetch("/api/status", { credentials: "same-origin", cache: "no-store" });
    if (reply.status === 401) throw new Error("this server needs an API key: reload the page and give it as the password");
    if (!reply.ok) throw new Error(`/api/status answered ${reply.status}`);
    const doc = await reply.json();
    wait = 1000 * doc.refresh_s;
    render(doc);
  } catch (err) {
    $("#notice").hidden = false;
    $("#notice").textContent = String(err.message || err);
  }
  setTimeout(poll, wait);
}

$("#playground form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = event.target, out = $("#answer");
  out.textContent = "…";
  const body = { model: form.model.value, messages: [{ role: "user", content: form.prompt.value }], max_tokens: 128 };
  const reply = await fetch("/v1/chat/completions", {
    method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const doc = await reply.json();
  out.textContent = reply.ok ? doc.choices[0].message.content : JSON.stringify(doc.error || doc);
});

poll();
