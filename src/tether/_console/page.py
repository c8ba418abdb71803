# ruff: noqa: E501 (HTML and JavaScript, not Python)
"""The console's one page: plain HTML and JavaScript, no build step. Every journal string is
set with ``textContent``, never parsed as HTML. Its one script and one style sheet are allowed
by their hashes in the Content-Security-Policy (``POLICY``): nothing else runs."""

import base64
import hashlib
import re

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tether console</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1em 2em; color: #222; }
 h1 { font-size: 1.3em; margin: 0 0 .3em 0; } h2 { font-size: 1.1em; margin: 1.2em 0 .4em 0; }
 code, .id { font-family: ui-monospace, monospace; white-space: nowrap; }
 table { border-collapse: collapse; } td, th { padding: 2px 8px; border-bottom: 1px solid #ddd;
 text-align: left; vertical-align: top; }
 .state { font-weight: 600; } .s-NEEDS_ATTENTION, .s-UNKNOWN, .s-FAILED { color: #b00; }
 .s-IN_DOUBT, .s-RUNNING, .s-RECALLING, .s-TERMINATING, .s-PENDING { color: #a60; }
 .s-COMPLETED, .s-SUCCEEDED, .s-RECALLED, .s-RECONCILED { color: #070; }
 ul.tree { list-style: none; padding-left: 1.2em; } li { margin: 2px 0; }
 #status { color: #666; } .err { color: #b00; } button { margin-left: 4px; }
 input.grace { width: 4em; } input.note { width: 18em; }
</style></head><body>
<h1>tether console <span id="status">connecting...</span></h1>
<div id="message" class="err" role="alert"></div>
<h2>Needs attention (<span id="attention-count">0</span>)</h2>
<table id="attention"><thead><tr><th>action</th><th>delegation</th><th>agent</th><th>tool</th>
<th>idempotency key</th><th>state</th><th>age</th><th>evidence</th><th>decide</th></tr></thead>
<tbody></tbody></table>
<h2>Delegations (<span id="delegation-count">0</span>, newest first)</h2>
<ul id="tree" class="tree"></ul>
<h2>Details <span id="detail-id" class="id"></span></h2>
<div id="detail"></div>
<script>
"use strict";
// The token arrives once, in the link the console printed; it then leaves the address bar
// (and history) at once, kept for this tab only; every request sends it in a header.
const token = new URLSearchParams(location.search).get("token") || sessionStorage.getItem("tether-token") || "";
sessionStorage.setItem("tether-token", token);
if (location.search) history.replaceState(null, "", "/");
let selected = null, snap = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function ago(ts, now) {
  if (ts === null || ts === undefined) return "";
  let s = Math.max(0, Math.floor(now - ts));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d";
}
function when(ts) { return ts ? new Date(ts * 1000).toISOString().replace("T", " ") : ""; }
function brief(ev) {
  if (!ev) return "";
  return Object.entries(ev).filter(([k]) => k !== "probed_at" && k !== "asked_at").map(([k, v]) =>
    k === "resolution" ? "decided " + v.outcome + " by " + v.operator + ": " + v.note
                       : k + "=" + (typeof v === "object" ? JSON.stringify(v) : v)).join(", ");
}
function row(cells) {
  const tr = el("tr");
  for (const c of cells) { const td = el("td"); if (c instanceof Node) td.append(c); else td.textContent = c ?? ""; tr.append(td); }
  return tr;
}
function stateSpan(s) { return el("span", s, "state s-" + s); }
function say(text) { document.getElementById("message").textContent = text || ""; }

async function post(path, body) {
  const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json",
    "X-Tether-Token": token}, body: JSON.stringify(body)});
  const data = await r.json();
  if (!r.ok) { say(data.error || r.statusText); return null; }
  say(""); return data;
}

function renderAttention() {
  const body = document.querySelector("#attention tbody");
  body.replaceChildren();
  document.getElementById("attention-count").textContent = snap.attention.length;
  for (const a of snap.attention) {
    const pick = el("select"); pick.dataset.testid = "outcome-" + a.id;
    for (const o of ["COMPLETED", "NOT_APPLIED"]) pick.append(el("option", o));
    const note = el("input", null, "note"); note.placeholder = "why: what you checked";
    note.dataset.testid = "note-" + a.id;
    const go = el("button", "Resolve"); go.dataset.testid = "resolve-" + a.id;
    go.onclick = async () => {
      const done = await post("/api/actions/" + encodeURIComponent(a.id) + "/resolve",
                              {outcome: pick.value, note: note.value});
      if (done) say("resolved " + a.id + " as " + done.action.state);
    };
    const decide = el("span"); decide.append(pick, note, go);
    const link = el("a", a.delegation, "id"); link.href = "#"; link.onclick = () => { select(a.delegation); return false; };
    body.append(row([el("span", a.id, "id"), link, a.agent, a.tool, el("span", a.idempotency_key, "id"),
                     stateSpan(a.state), ago(a.started_at, snap.now), brief(a.evidence), decide]));
  }
}

function renderTree() {
  const tree = document.getElementById("tree");
  tree.replaceChildren();
  document.getElementById("delegation-count").textContent = snap.delegations.length;
  const nodes = new Map();
  for (const d of snap.delegations) {
    const li = el("li"); li.dataset.testid = "delegation-" + d.id;
    const link = el("a", d.id, "id"); link.href = "#"; link.onclick = () => { select(d.id); return false; };
    li.append(link, " ", el("span", d.agent), " ", stateSpan(d.state), " ",
              el("span", ago(d.created_at, snap.now)));
    if (!["SUCCEEDED", "FAILED", "RECALLED", "TERMINATED", "RECONCILED", "NEEDS_ATTENTION",
          "SUCCEEDED_PARTIAL", "CANCELLED", "INTERRUPTED"].includes(d.state)) {
      const grace = el("input", null, "grace"); grace.value = "30"; grace.title = "grace (s)";
      grace.dataset.testid = "grace-" + d.id;
      const recall = el("button", "Recall"); recall.dataset.testid = "recall-" + d.id;
      recall.onclick = async () => {
        const r = await post("/api/delegations/" + encodeURIComponent(d.id) + "/recall",
                             {grace: Number(grace.value), reason: "from the console"});
        if (r) say("RECALL accepted for " + r.delegation + " (sequence " + r.seq + ")");
      };
      const term = el("button", "Terminate"); term.dataset.testid = "terminate-" + d.id;
      term.onclick = async () => {
        if (!confirm("Terminate " + d.id + " now?")) return;
        const r = await post("/api/delegations/" + encodeURIComponent(d.id) + "/terminate",
                             {reason: "from the console"});
        if (r) say("TERMINATE accepted for " + r.delegation);
      };
      li.append(" ", grace, recall, term);
    }
    li.append(el("ul", null, "tree"));
    nodes.set(d.id, li);
  }
  for (const d of snap.delegations) {
    const parent = d.parent && nodes.get(d.parent);
    (parent ? parent.querySelector("ul") : tree).append(nodes.get(d.id));
  }
}

function table(headers, rows) {
  const t = el("table"), head = el("tr");
  for (const h of headers) head.append(el("th", h));
  t.append(head); for (const r of rows) t.append(row(r)); return t;
}

async function select(id) {
  selected = id;
  const r = await fetch("/api/delegations/" + encodeURIComponent(id), {headers: {"X-Tether-Token": token}});
  const data = await r.json();
  const box = document.getElementById("detail");
  document.getElementById("detail-id").textContent = id;
  if (!r.ok) { box.replaceChildren(el("p", data.error, "err")); return; }
  box.replaceChildren(
    el("h3", "actions"),
    table(["id", "delegation", "tool", "effect", "idempotency key", "state", "started", "evidence"],
      data.actions.map(a => [el("span", a.id, "id"), el("span", a.delegation, "id"), a.tool, a.effect,
        el("span", a.idempotency_key, "id"), stateSpan(a.state) , when(a.started_at), brief(a.evidence)])),
    el("h3", "signed intents and documents"),
    table(["delegation", "seq", "kind", "key", "signature", "at", "detail"],
      data.intents.map(i => [el("span", i.delegation, "id"), i.seq, i.kind, el("span", i.key_id, "id"),
        i.verified === "ok" ? "verified" : i.verified, when(i.accepted_at),
        i.body.reason || i.body.note || ""])),
    el("h3", "decisions"),
    table(["at", "action", "decision", "by", "key", "note"],
      data.decisions.map(d => [when(d.at), el("span", d.action, "id"),
        d.kind === "resolved" ? d.old + " -> " + d.outcome : "CONTRADICTED by " + d.new,
        d.operator || "", el("span", d.key_id || "", "id"), d.note || ""])),
    el("h3", "events"),
    table(["at", "delegation / action", "event", "detail"],
      data.events.map(e => [when(e.at), el("span", e.action || e.delegation || "", "id"), e.kind,
        Object.entries(e.detail).map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v) : v)).join(", ")])));
}

function onSnapshot(data) {
  snap = JSON.parse(data);
  document.getElementById("status").textContent = "live (journal event " + (snap.version ?? 0) + ")";
  document.body.dataset.version = snap.version ?? 0;
  renderAttention(); renderTree();
  if (selected) select(selected);
}

// Server-sent events read with fetch, not EventSource, so that the stream too carries the
// token in a header: no cookie (every port of 127.0.0.1 would get it) and no URL holds it.
async function connect() {
  for (;;) {
    try {
      const r = await fetch("/api/stream", {headers: {"X-Tether-Token": token, "Accept": "text/event-stream"}});
      if (!r.ok) { say((await r.json()).error || r.statusText); throw new Error(r.statusText); }
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf = (buf + value).replace(/\\r\\n/g, "\\n");
        let end;
        while ((end = buf.indexOf("\\n\\n")) >= 0) {
          const block = buf.slice(0, end); buf = buf.slice(end + 2);
          let kind = "message"; const data = [];
          for (const line of block.split("\\n")) {
            if (line.startsWith("event:")) kind = line.slice(6).trim();
            else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          }
          if (kind === "snapshot") onSnapshot(data.join("\\n"));
        }
      }
    } catch (e) { /* the server went away or refused: try again */ }
    document.getElementById("status").textContent = "reconnecting...";
    await new Promise(done => setTimeout(done, 1000));
  }
}
connect();
</script></body></html>
"""


def _digest(tag: str) -> str:
    (body,) = re.findall(rf"<{tag}>(.*?)</{tag}>", PAGE, flags=re.S)
    return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"


POLICY = (f"default-src 'none'; script-src {_digest('script')}; style-src {_digest('style')}; "
          "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
          "frame-ancestors 'none'")
