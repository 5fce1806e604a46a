// The TandemLLM dashboard: plain JavaScript, no library, no network beyond this server.
// Live data comes from /dash/events (server-sent events read with fetch, so the API key can go in a header).
"use strict";

(function () {
  const KEY_NAME = "tandem-dash-key";
  const MAX_POINTS = 200;
  const dash = { rows: [], state: null, flights: new Map(), connected: false, events: 0, ledgerTimer: null };
  window.tandemDash = dash;     // for the browser test and for a curious user's console

  // -- helpers ------------------------------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function row(cells, numeric) {
    const tr = document.createElement("tr");
    cells.forEach(function (c, i) {
      const td = c instanceof Node ? (function () { const t = document.createElement("td"); t.appendChild(c); return t; })()
                                   : el("td", c);
      if (numeric && numeric.indexOf(i) >= 0) td.className = "num";
      tr.appendChild(td);
    });
    return tr;
  }
  function fill(tbody, rows) {
    while (tbody.firstChild) tbody.removeChild(tbody.firstChild);
    rows.forEach(function (r) { tbody.appendChild(r); });
  }
  function defs(dl, pairs) {
    while (dl.firstChild) dl.removeChild(dl.firstChild);
    pairs.forEach(function (p) { dl.appendChild(el("dt", p[0])); dl.appendChild(el("dd", p[1])); });
  }
  function bytes(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(n), u = 0;
    while (Math.abs(v) >= 1024 && u < units.length - 1) { v /= 1024; u += 1; }
    return (u === 0 ? v.toFixed(0) : v.toFixed(2)) + " " + units[u];
  }
  function num(v, digits) { return v === null || v === undefined ? "-" : Number(v).toFixed(digits); }
  function money(v) { return v === null || v === undefined ? "-" : "$" + Number(v).toFixed(6); }
  function clock(ts) { return new Date(ts * 1000).toLocaleTimeString(); }
  function stamp(ts) { const d = new Date(ts * 1000); return d.toLocaleDateString() + " " + d.toLocaleTimeString(); }
  function headers() {
    const key = sessionStorage.getItem(KEY_NAME);
    return key ? { Authorization: "Bearer " + key } : {};
  }
  async function api(path) {
    const r = await fetch(path, { headers: headers(), cache: "no-store" });
    if (r.status === 401) { askKey(); throw new Error("unauthorized"); }
    if (!r.ok) throw new Error(path + ": " + r.status);
    return r.json();
  }
  function askKey(message) {
    $("keyform").classList.remove("hidden");
    $("keyerror").textContent = message || "";
  }

  // -- the live page ------------------------------------------------------------------------------------
  function renderFlights() {
    const now = Date.now() / 1000;
    const rows = [];
    dash.flights.forEach(function (f) {
      rows.push(row([f.id, f.model, f.backend, f.endpoint, f.stream ? "yes" : "no",
                     num(now - f.since, 1) + " s", f.first ? "yes" : "waiting"], [0]));
    });
    fill($("flights").tBodies[0], rows);
    $("inflight-count").textContent = String(dash.flights.size);
    $("flights-empty").classList.toggle("hidden", dash.flights.size > 0);
  }

  function renderState(s) {
    dash.state = s;
    dash.flights = new Map(s.flights.map(function (f) { return [f.id, f]; }));
    renderFlights();
    const local = s.local;
    if (local) {
      defs($("local"), [["model", local.model], ["engines", local.engines], ["busy", local.busy],
                        ["queued", local.waiting + " of " + local.queue],
                        ["side lane waiting", local.side_lane.waiting], ["side lane served", local.side_lane.served]]);
      const sp = local.speculation || {};
      defs($("spec"), [["enabled", sp.enabled ? "yes" : "no" + (sp.reason ? " (" + sp.reason + ")" : "")],
                       ["drafters", (sp.drafters || []).join(", ") || "-"], ["rounds", sp.rounds === undefined ? "-" : sp.rounds],
                       ["tokens a round", num(sp.tokens_per_round, 2)], ["acceptance", num(sp.acceptance, 3)]]);
      const sc = sp.selfcheck;
      const v = $("selfcheck");
      if (sc && typeof sc === "object") {
        v.textContent = sc.ok ? "passed (" + (sc.rows || 0) + " rows bit for bit, widths " + (sc.widths || []).join(",") + ")"
                              : "failed" + (sc.mismatch ? ": " + JSON.stringify(sc.mismatch) : "");
        v.className = "verdict " + (sc.ok ? "ok" : "bad");
      } else {
        v.textContent = sp.enabled === false && sp.reason ? "not run (" + sp.reason + ")" : "pending";
        v.className = "verdict";
      }
      const tiers = (local.caches && local.caches.tiers) || [];
      fill($("caches").tBodies[0], tiers.map(function (t) {
        const asked = (t.hits || 0) + (t.misses || 0);
        return row([t.tier, bytes(t.bytes), t.entries, t.hits, t.misses,
                    asked ? (100 * t.hits / asked).toFixed(1) + " %" : "-"], [1, 2, 3, 4, 5]);
      }));
      if (!tiers.length) fill($("caches").tBodies[0], [row([local.caches && local.caches.enabled === false ? "caches off" : "-", "", "", "", "", ""])]);
      const mem = $("memory");
      while (mem.firstChild) mem.removeChild(mem.firstChild);
      const most = Math.max.apply(null, [1].concat(local.memory.map(function (m) { return m.bytes; })));
      local.memory.forEach(function (m) {
        const line = el("div", null, "barrow");
        line.appendChild(el("span", m.name));
        const bar = el("div", null, "bar");
        bar.style.width = (100 * m.bytes / most).toFixed(1) + "%";
        line.appendChild(bar);
        line.appendChild(el("span", bytes(m.bytes)));
        mem.appendChild(line);
      });
    } else {
      defs($("local"), [["model", "none (tandem-dash: the proxy alone)"]]);
      defs($("spec"), [["enabled", "-"]]);
      $("selfcheck").textContent = "-";
    }
    const backs = s.backends || [];
    fill($("backends").tBodies[0], backs.map(function (b) {
      const health = el("span", b.ok === null ? "unchecked" : b.ok ? "up" : "down", b.ok ? "ok" : b.ok === false ? "bad" : "");
      return row([b.name, health, b.latency_ms === null ? "-" : num(b.latency_ms, 1) + " ms",
                  (b.models || []).join(", "), b.inflight, b.requests, b.failures, b.error || ""], [4, 5, 6]);
    }));
    $("backends-empty").classList.toggle("hidden", backs.length > 0);
  }

  function rowCells(r, withId) {
    const cells = [clock(r.ts)];
    if (withId) cells.push(r.request_id);
    return cells.concat([r.model, r.backend, r.status, r.finish_reason, r.prompt_tokens,
                         r.completion_tokens + (r.counted ? " (counted)" : ""), num(r.ttft_s, 3), num(r.decode_tps, 1),
                         money(r.cost)]);
  }

  function renderRows() {
    const last = dash.rows.slice(-50).reverse();
    fill($("rows").tBodies[0], last.map(function (r) {
      const tr = row(rowCells(r, false), [5, 6, 7, 8, 9]);
      tr.dataset.request = r.request_id;
      return tr;
    }));
    plot($("plot-tps"), dash.rows, "decode_tps", "#2f5fd0");
    plot($("plot-ttft"), dash.rows, "ttft_s", "#d07a2f");
  }

  // a line over time of one field of the completed rows, on a canvas
  function plot(canvas, rows, field, color) {
    const ctx = canvas.getContext("2d");
    const W = canvas.width, H = canvas.height, L = 46, R = 10, T = 10, B = 24;
    ctx.clearRect(0, 0, W, H);
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, W, H);
    const pts = rows.filter(function (r) { return r[field] !== null && r[field] !== undefined; })
                    .slice(-MAX_POINTS).map(function (r) { return [r.ts + (r.duration_s || 0), Number(r[field])]; });
    canvas.dataset.points = String(pts.length);
    ctx.strokeStyle = "#c9ced6";
    ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(L, T); ctx.lineTo(L, H - B); ctx.lineTo(W - R, H - B); ctx.stroke();
    ctx.fillStyle = "#6b7280";
    ctx.font = "11px sans-serif";
    if (!pts.length) { ctx.fillText("no requests yet", L + 10, H / 2); return; }
    const t0 = pts[0][0], t1 = Math.max(pts[pts.length - 1][0], t0 + 1);
    const top = Math.max.apply(null, pts.map(function (p) { return p[1]; })) * 1.1 || 1;
    const x = function (t) { return L + (W - L - R) * (t - t0) / (t1 - t0); };
    const y = function (v) { return H - B - (H - B - T) * v / top; };
    [0, 0.5, 1].forEach(function (f) {
      ctx.fillText((top * f).toFixed(top * f >= 10 ? 0 : 2), 4, y(top * f) + 4);
      ctx.strokeStyle = "#eef0f3";
      ctx.beginPath(); ctx.moveTo(L, y(top * f)); ctx.lineTo(W - R, y(top * f)); ctx.stroke();
    });
    ctx.fillText(clock(t0), L, H - 6);
    if (t1 - t0 > 1) ctx.fillText(clock(t1), W - R - 60, H - 6);
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    pts.forEach(function (p, i) { if (i === 0) ctx.moveTo(x(p[0]), y(p[1])); else ctx.lineTo(x(p[0]), y(p[1])); });
    ctx.stroke();
    pts.forEach(function (p) { ctx.beginPath(); ctx.arc(x(p[0]), y(p[1]), 3, 0, 2 * Math.PI); ctx.fill(); });
  }

  // -- the ledger page ----------------------------------------------------------------------------------
  async function loadLedger() {
    const by = $("by").value;
    const data = await api("/dash/api/ledger?by=" + encodeURIComponent(by) + "&n=200");
    const t = data.totals;
    defs($("totals"), t ? [["requests", t.requests], ["prompt tokens", t.prompt_tokens],
                           ["completion tokens", t.completion_tokens], ["cost", money(t.cost)], ["errors", t.errors]]
                        : [["requests", "no ledger file"]]);
    $("group-key").textContent = by;
    fill($("groups").tBodies[0], (data.groups || []).map(function (g) {
      return row([g.key, g.requests, g.prompt_tokens, g.completion_tokens, money(g.cost), g.errors,
                  num(g.mean_ttft_s, 3), num(g.mean_decode_tps, 1)], [1, 2, 3, 4, 5, 6, 7]);
    }));
    fill($("ledger-rows").tBodies[0], data.rows.slice().reverse().map(function (r) {
      const cells = rowCells(r, true);
      cells[0] = stamp(r.ts);
      return row(cells, [6, 7, 8, 9, 10]);
    }));
  }
  function ledgerSoon() {
    if (dash.ledgerTimer) return;
    dash.ledgerTimer = setTimeout(function () {
      dash.ledgerTimer = null;
      if (location.hash === "#/ledger") loadLedger().catch(report);
    }, 500);
  }

  // -- the setup guide ----------------------------------------------------------------------------------
  function copyLine(text) {
    const pre = el("pre", null, "copy");
    pre.appendChild(el("code", text));
    const b = el("button", "copy");
    b.type = "button";
    b.addEventListener("click", function () {
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(function () { b.textContent = "copied"; }, function () { select(pre); });
      } else {
        select(pre);
      }
    });
    pre.appendChild(b);
    return pre;
  }
  function select(node) {
    const range = document.createRange();
    range.selectNodeContents(node.firstChild);
    const sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
  }
  function table(head, rows, numeric) {
    const t = document.createElement("table");
    const th = document.createElement("thead");
    th.appendChild(row(head));
    Array.prototype.forEach.call(th.querySelectorAll("td"), function (td) {
      const h = el("th", td.textContent);
      td.replaceWith(h);
    });
    t.appendChild(th);
    const tb = document.createElement("tbody");
    rows.forEach(function (r) { tb.appendChild(row(r, numeric)); });
    t.appendChild(tb);
    return t;
  }
  async function loadSetup() {
    const data = await api("/dash/api/setup");
    const box = $("tiles");
    while (box.firstChild) box.removeChild(box.firstChild);
    data.models.forEach(function (m) {
      const tile = el("div", null, "card tile");
      tile.dataset.model = m.id;
      const h = el("h3", m.name + " ");
      if (m.default) h.appendChild(el("span", "default", "tag default"));
      tile.appendChild(h);
      const tags = el("p");
      [m.id, m.family, m.plugin, (m.params_b === null || m.params_b === undefined ? "?" : m.params_b) + " B params",
       "context " + m.context, "methods " + m.methods.join(", "),
       "up to " + (m.parallel.max || 1) + " in parallel"].forEach(function (t) { tags.appendChild(el("span", t, "tag")); });
      tile.appendChild(tags);
      tile.appendChild(el("p", m.description, "muted"));
      tile.appendChild(el("h4", "Weight profiles"));
      tile.appendChild(table(["profile", "dtype", "bits/param", "weights", "device", "recommended"],
        m.profiles.map(function (p) {
          return [p.name, p.dtype, p.bits_per_param, num(p.weights_gib, 3) + " GiB", p.device || "-", p.recommended ? "yes" : ""];
        }), [2, 3]));
      tile.appendChild(el("h4", "Measured"));
      if (m.measured.length) {
        tile.appendChild(table(["what", "value", "device", "command"], m.measured.map(function (x) {
          return [x.what, x.value + (x.unit ? " " + x.unit : ""), x.device || "-", x.command || "-"];
        }), [1]));
      } else {
        tile.appendChild(el("p", "no measurements recorded in this entry", "muted"));
      }
      tile.appendChild(el("h4", "Memory (profile " + (m.memory.profile || "-") + ", KV " + bytes(m.memory.kv_bytes_per_token) +
                                " a token" + (m.memory.kv_dtype ? " in " + m.memory.kv_dtype : "") + ")"));
      tile.appendChild(table(["context", "weights", "KV", "recurrent state", "total"], m.memory.table.map(function (r) {
        return [r.context, num(r.weights_gib, 2) + " GiB", num(r.kv_gib, 2) + " GiB", num(r.state_gib, 2) + " GiB",
                num(r.total_gib, 2) + " GiB"];
      }), [0, 1, 2, 3, 4]));
      tile.appendChild(el("h4", "Get it and serve it"));
      tile.appendChild(copyLine(m.commands.pull));
      tile.appendChild(copyLine(m.commands.serve));
      box.appendChild(tile);
    });
    box.dataset.loaded = String(data.models.length);
  }

  // -- the live connection ------------------------------------------------------------------------------
  function handle(kind, data) {
    dash.events += 1;
    if (kind === "hello") {
      dash.rows = data.rows;
      renderState(data.state);
      renderRows();
    } else if (kind === "state") {
      renderState(data);
    } else if (kind === "start") {
      dash.flights.set(data.id, data);
      renderFlights();
    } else if (kind === "end") {
      dash.flights.delete(data.id);
      renderFlights();
    } else if (kind === "row") {
      dash.rows.push(data);
      if (dash.rows.length > 2000) dash.rows.splice(0, dash.rows.length - 2000);
      renderRows();
      ledgerSoon();
    }
  }

  function setConnected(on) {
    dash.connected = on;
    const c = $("conn");
    c.textContent = on ? "live" : "reconnecting";
    c.className = "conn " + (on ? "on" : "off");
  }

  async function connect() {
    let r;
    try {
      r = await fetch("/dash/events", { headers: headers(), cache: "no-store" });
    } catch (e) {
      setConnected(false);
      setTimeout(connect, 2000);
      return;
    }
    if (r.status === 401) { setConnected(false); askKey(); return; }
    if (!r.ok || !r.body) { setConnected(false); setTimeout(connect, 2000); return; }
    setConnected(true);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const part = await reader.read();
        if (part.done) break;
        buf += decoder.decode(part.value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let kind = "message";
          const data = [];
          block.split("\n").forEach(function (line) {
            if (line.indexOf("event:") === 0) kind = line.slice(6).trim();
            else if (line.indexOf("data:") === 0) data.push(line.slice(5).replace(/^ /, ""));
          });
          if (data.length) handle(kind, JSON.parse(data.join("\n")));
        }
      }
    } catch (e) {
      // the server went away: reconnect below
    }
    setConnected(false);
    setTimeout(connect, 2000);
  }

  // -- pages --------------------------------------------------------------------------------------------
  function route() {
    const page = (location.hash.replace(/^#\/?/, "") || "live").split("/")[0];
    const known = ["live", "ledger", "setup"].indexOf(page) >= 0 ? page : "live";
    ["live", "ledger", "setup"].forEach(function (p) {
      $("page-" + p).classList.toggle("hidden", p !== known);
      $("nav-" + p).classList.toggle("active", p === known);
    });
    if (known === "ledger") loadLedger().catch(report);
    if (known === "setup") loadSetup().catch(report);
  }
  function report(e) {
    if (e && e.message === "unauthorized") return;
    $("conn").textContent = "error: " + (e && e.message ? e.message : String(e));
  }

  document.addEventListener("DOMContentLoaded", function () {
    $("keyform").addEventListener("submit", function (ev) {
      ev.preventDefault();
      sessionStorage.setItem(KEY_NAME, $("key").value);
      $("keyform").classList.add("hidden");
      connect();
      route();
    });
    $("by").addEventListener("change", function () { loadLedger().catch(report); });
    window.addEventListener("hashchange", route);
    setInterval(renderFlights, 1000);
    route();
    renderRows();
    connect();
  });
})();
