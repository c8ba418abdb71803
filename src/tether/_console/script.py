# ruff: noqa: E501 (JavaScript, not Python)
"""The console's one script: it holds the access token, fetches each view's server-rendered
HTML with it (in a header), follows links and filters without a reload, posts the operator's
forms, and re-reads the view whenever the journal changes (server-sent events). Served inline,
allowed by its hash (``page.POLICY``)."""

SCRIPT = r"""
"use strict";
// The token arrives once, in the link the console printed; it then leaves the address bar
// (and history) at once, kept for this tab only; every request sends it in a header.
const given = new URLSearchParams(location.search).get("token");
const token = given || sessionStorage.getItem("tether-token") || "";
sessionStorage.setItem("tether-token", token);
if (given) {
  const rest = new URLSearchParams(location.search); rest.delete("token");
  history.replaceState(null, "", location.pathname + (rest.toString() ? "?" + rest : ""));
}
const view = document.getElementById("view");
let loading = null, again = false, version = null;

function say(text, bad) {
  const m = document.getElementById("message");
  m.textContent = text || ""; m.className = bad ? "err" : "";
}
function here() { return location.pathname + location.search; }

// The operator's half-typed note or reason survives a live refresh of the same view.
function typed() {
  const kept = new Map();
  for (const f of view.querySelectorAll("input, select, textarea")) {
    if (!f.dataset.testid) continue;
    kept.set(f.dataset.testid, {value: f.value, checked: f.checked, focus: f === document.activeElement,
                               start: f.selectionStart, end: f.selectionEnd});
  }
  return kept;
}
function retype(kept) {
  for (const f of view.querySelectorAll("input, select, textarea")) {
    const k = kept.get(f.dataset.testid);
    if (!k) continue;
    if (f.type === "radio" || f.type === "checkbox") f.checked = k.checked; else f.value = k.value;
    if (k.focus) { f.focus(); try { f.setSelectionRange(k.start, k.end); } catch (e) { /* not text */ } }
  }
}

async function show(fresh) {
  if (loading) { again = true; return loading; }
  loading = (async () => {
    const path = here();
    try {
      const r = await fetch("/api/view" + path, {headers: {"X-Tether-Token": token}});
      const html = await r.text();
      if (path !== here()) { again = true; return; }  // the operator moved on meanwhile
      if (r.status === 401) { say("missing or wrong access token: open the link tether console printed", true); return; }
      // What the operator typed is read at the last moment (they may have typed while the
      // view was fetched), then put back into the new view.
      const kept = fresh ? new Map() : typed();
      // Server-rendered, every journal string escaped there; the policy runs no inline code.
      view.innerHTML = html;
      const jump = view.querySelector("[data-redirect]");
      if (jump) { history.replaceState(null, "", jump.dataset.redirect); again = true; return; }
      retype(kept);
      later();
      if (fresh && location.hash) {
        let id = location.hash.slice(1);
        try { id = decodeURIComponent(id); } catch (e) { /* a bare "%": the id as written */ }
        const target = document.getElementById(id);
        if (target) target.scrollIntoView();
      }
      const h = view.querySelector("h1");
      document.title = (h ? h.textContent.trim() + " - " : "") + "tether console";
      for (const a of document.querySelectorAll("header.top nav a"))
        a.classList.toggle("active", a.dataset.section === section());
      document.body.dataset.shown = path;
      document.body.dataset.renders = Number(document.body.dataset.renders || 0) + 1;
    } catch (e) {
      say("cannot reach the console: " + e, true);
    } finally {
      loading = null;
      if (again) { again = false; show(false); }
    }
  })();
  return loading;
}
// A deadline the view explains (when NOT_APPLIED becomes possible) re-reads it once passed.
let timer = null;
function later() {
  clearTimeout(timer);
  const due = [...view.querySelectorAll("[data-until]")].map(x => Number(x.dataset.until) * 1000);
  if (due.length) timer = setTimeout(() => show(false), Math.max(0, Math.min(...due) - Date.now()) + 250);
}
function section() {
  const p = location.pathname;
  return p.startsWith("/d/") || p.startsWith("/delegations") ? "delegations"
       : p.startsWith("/actions") ? "actions" : "queue";
}
function go(url) { history.pushState(null, "", url); say(""); window.scrollTo(0, 0); show(true); }

document.addEventListener("click", ev => {
  const a = ev.target.closest("a[href]");
  if (!a || ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey) return;
  const url = new URL(a.href, location.href);
  if (url.origin !== location.origin || url.pathname.startsWith("/api/")) return;
  ev.preventDefault();
  go(url.pathname + url.search + url.hash);
});
window.addEventListener("popstate", () => show(true));

async function post(path, body) {
  const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json",
    "X-Tether-Token": token}, body: JSON.stringify(body)});
  let data = {};
  try { data = await r.json(); } catch (e) { data = {error: r.statusText}; }
  if (!r.ok) { say(data.error || r.statusText, true); return null; }
  return data;
}
function need(field, text) {
  if (field.value.trim()) { field.removeAttribute("aria-invalid"); return true; }
  field.setAttribute("aria-invalid", "true"); field.focus(); say(text, true); return false;
}

document.addEventListener("submit", async ev => {
  const form = ev.target;
  ev.preventDefault();
  if (form.dataset.nav !== undefined) {
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (String(v).trim()) q.set(k, String(v).trim());
    go(form.dataset.nav + (q.toString() ? "?" + q : ""));
    return;
  }
  if (!form.dataset.post) return;
  const data = new FormData(form), button = ev.submitter;
  if (form.dataset.what === "decision") {
    const outcome = data.get("outcome");
    if (!outcome) { say("choose what happened: COMPLETED or NOT_APPLIED", true); return; }
    if (!need(form.elements.note, "a decision needs a note: say what you checked")) return;
    button.disabled = true;
    const done = await post(form.dataset.post, {outcome: outcome, note: form.elements.note.value});
    button.disabled = false;
    if (done) say("recorded: " + done.action.id + " is " + done.action.state);
  } else {
    const verb = button && button.value === "terminate" ? "terminate" : "recall";
    if (!need(form.elements.reason, "a " + verb + " needs a reason: say why it is stopped")) return;
    if (button && button.dataset.confirm && !confirm(button.dataset.confirm)) return;
    button.disabled = true;
    const body = {reason: form.elements.reason.value};
    if (verb === "recall") body.grace = Number(form.elements.grace.value || "30");
    const done = await post(form.dataset.post + verb, body);
    button.disabled = false;
    if (done) say(done.kind + " accepted for " + done.delegation + " (sequence " + done.seq + ")");
  }
  show(true);
});

function count(n) {
  const pill = document.getElementById("attention-pill");
  pill.textContent = n; pill.classList.toggle("zero", n === 0);
}

// Server-sent events read with fetch, not EventSource, so that the stream too carries the
// token in a header: no cookie (every port of 127.0.0.1 would get it) and no URL holds it.
async function connect() {
  for (;;) {
    try {
      const r = await fetch("/api/stream", {headers: {"X-Tether-Token": token, "Accept": "text/event-stream"}});
      if (!r.ok) { say((await r.json()).error || r.statusText, true); throw new Error(r.statusText); }
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf = (buf + value).replace(/\r\n/g, "\n");
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, end); buf = buf.slice(end + 2);
          let kind = "message"; const data = [];
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) kind = line.slice(6).trim();
            else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          }
          if (kind !== "change") continue;
          const change = JSON.parse(data.join("\n"));
          document.getElementById("status").textContent = "live (journal event " + change.version + ")";
          document.body.dataset.version = change.version;
          count(change.attention);
          // Each change re-reads the view (the first too: the journal may have moved since
          // the view was first read).
          if (change.version !== version) show(false);
          version = change.version;
        }
      }
    } catch (e) { /* the server went away or refused: try again */ }
    document.getElementById("status").textContent = "reconnecting...";
    await new Promise(done => setTimeout(done, 1000));
  }
}
show(true);
connect();
"""
