// The pdserve dashboard: polls /dashboard/state once a second and draws it. Strings go in as text nodes only.
"use strict";

const PHASES = ["d2h", "serialize", "wire", "deserialize", "convert", "h2d"];
const COLORS = ["#3b7dd8", "#e08a2e", "#2f9e62", "#9b59b6", "#c0392b", "#7f8c8d"];
const HISTORY = 120;  // points of each time series
const history = {requests: [], ttft: [], tpot: [], itl: []};
let key = sessionStorage.getItem("pdserve-key");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "style") node.style.cssText = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function fmt(x, digits = 1) {
  return x == null || Number.isNaN(x) ? "-" : Number(x).toFixed(digits);
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function replace(id, ...children) {
  document.getElementById(id).replaceChildren(...children);
}

function workers(rows) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren(...rows.map((w) => {
    const total = w.kv_blocks || 0, used = total ? total - (w.kv_blocks_free || 0) : 0;
    const share = total ? used / total : 0;
    const pool = el("span", {}, el("span", {class: "bar", title: `${used} of ${total} blocks`},
      el("span", {style: `width:${(share * 100).toFixed(0)}%`})), ` ${(share * 100).toFixed(0)}%`);
    const health = el("span", {class: w.healthy ? "ok" : "bad"}, w.healthy ? "healthy" : "unhealthy");
    return el("tr", {"data-address": w.address}, el("td", {}, w.role), el("td", {}, w.address), el("td", {}, health),
      el("td", {}, w.drain || ""), el("td", {}, w.engine || ""),
      el("td", {}, `${w.device || "-"} / ${w.tp || 1} / ${w.pp || 1}`), el("td", {}, w.pid ?? "-"),
      el("td", {}, w.restarts ?? 0), el("td", {}, w.active ?? w.outstanding ?? 0), el("td", {}, w.waiting ?? 0),
      el("td", {}, pool), el("td", {}, fmt(w.step_ms, 2)));
  }));
}

function card(label, value, id) {
  return el("div", {class: "card", ...(id ? {id} : {})}, el("span", {class: "muted"}, label), el("b", {}, value));
}

function spark(label, points, unit) {
  const width = 260, height = 60, top = Math.max(1e-9, ...points.filter((p) => p != null));
  const box = svg("svg", {width, height, role: "img"});
  const line = points.map((p, i) => p == null ? null : `${(i / (HISTORY - 1)) * width},${height - 4 - (p / top) * (height - 16)}`)
    .filter(Boolean).join(" ");
  box.append(svg("polyline", {points: line, fill: "none", stroke: "#3b7dd8", "stroke-width": 1.5}));
  const caption = svg("text", {x: 4, y: 12, "font-size": 11, fill: "#48525c"});
  caption.textContent = `${label}: ${fmt(points[points.length - 1])} ${unit} (max ${fmt(top)})`;
  box.append(caption);
  return box;
}

function traffic(t) {
  replace("traffic", card("requests", t.requests_total, "requests-total"), card("requests/s", fmt(t.requests_per_s, 2)),
    card("errors/s", fmt(t.errors_per_s, 2)), card("retries/s", fmt(t.retries_per_s, 2)),
    card("tokens/s", fmt(t.tokens_per_s)), card("in flight", t.in_flight), card("queued", t.queued),
    card("TTFT p50 / p99 ms", `${fmt(t.ttft_ms.p50)} / ${fmt(t.ttft_ms.p99)}`),
    card("TPOT p50 / p99 ms", `${fmt(t.tpot_ms.p50)} / ${fmt(t.tpot_ms.p99)}`),
    card("ITL p50 / p99 ms", `${fmt(t.itl_ms.p50)} / ${fmt(t.itl_ms.p99)}`));
  for (const [name, value] of [["requests", t.requests_per_s], ["ttft", t.ttft_ms.p99], ["tpot", t.tpot_ms.p99],
    ["itl", t.itl_ms.p99]]) {
    history[name].push(value);
    if (history[name].length > HISTORY) history[name].shift();
  }
  replace("series", spark("requests/s", history.requests, ""), spark("TTFT p99", history.ttft, "ms"),
    spark("TPOT p99", history.tpot, "ms"), spark("ITL p99", history.itl, "ms"));
}

function transfers(by) {
  replace("legend", ...PHASES.map((p, i) => el("span", {}, el("i", {style: `background:${COLORS[i]}`}), p)));
  const rows = Object.entries(by);
  if (!rows.length) return replace("transfers", el("p", {class: "muted"}, "no KV transfers yet"));
  const width = 520, row = 26, label = 150;
  const top = Math.max(1e-9, ...rows.map(([, t]) => PHASES.reduce((s, p) => s + (t.phases_ms[p] || 0), 0)));
  const box = svg("svg", {width: width + label + 300, height: rows.length * row + 8, role: "img"});
  rows.forEach(([name, t], i) => {
    const y = 4 + i * row;
    const text = svg("text", {x: 4, y: y + 15, "font-size": 12, fill: "#1d2329"});
    text.textContent = name;
    box.append(text);
    let x = label;
    PHASES.forEach((p, j) => {
      const w = ((t.phases_ms[p] || 0) / top) * width;
      if (w > 0) box.append(svg("rect", {x, y, width: w, height: 18, fill: COLORS[j]}));
      x += w;
    });
    const note = svg("text", {x: x + 6, y: y + 15, "font-size": 11, fill: "#48525c"});
    const total = PHASES.reduce((s, p) => s + (t.phases_ms[p] || 0), 0);
    note.textContent = `${fmt(total, 2)} ms, ${t.transfers} transfers, ${bytes(t.bytes_per_s)}/s`;
    box.append(note);
  });
  replace("transfers", box);
}

function prefixAndDisagg(s) {
  const t = s.tiers, ms = (v) => (v == null ? "-" : `${v.toFixed(1)} ms`);
  replace("prefix", card("prefix cache hit rate", s.prefix_hit_rate == null ? "-" : `${(s.prefix_hit_rate * 100).toFixed(1)}%`),
    card("tokens/s from host / disk / pool", ["host", "disk", "pool"].map((k) => t.tokens_per_s[k].toFixed(0)).join(" / ")),
    card(`tier moves (${t.moves}): fetch / load`, `${ms(t.phases_ms.fetch)} / ${ms(t.phases_ms.load)}`));
  document.querySelector("#disagg tbody").replaceChildren(...(s.disagg.length ? s.disagg.map((d) =>
    el("tr", {}, el("td", {}, d.where), el("td", {}, d.reason), el("td", {}, d.in_window))) :
    [el("tr", {}, el("td", {colspan: 3, class: "muted"}, "no decisions (every prompt goes one way)"))]));
}

async function poll() {
  try {
    const headers = key ? {Authorization: `Bearer ${key}`} : {};
    const r = await fetch("/dashboard/state", {headers, cache: "no-store"});
    if (r.status === 401) {
      key = window.prompt("API key") || "";
      sessionStorage.setItem("pdserve-key", key);
      return;
    }
    const s = await r.json();
    const up = s.workers.filter((w) => w.healthy).length;
    replace("status", el("span", {class: s.status ? "ok" : "bad"}, s.status ? "serving" : "not serving"),
      ` · ${s.mode} · ${up} of ${s.workers.length} workers healthy · ${new Date(s.time * 1000).toLocaleTimeString()}`);
    workers(s.workers);
    traffic(s.traffic);
    transfers(s.transfers);
    prefixAndDisagg(s);
  } catch (e) {
    replace("status", el("span", {class: "bad"}, `router unreachable (${e.message})`));
  }
}

poll();
setInterval(poll, 1000);
