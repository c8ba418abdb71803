"""The console's one style sheet: legible type, a layout that reads from a laptop's 1280 px up,
and every state in colour and in words (never colour alone). Served inline, allowed by its
hash (``page.POLICY``)."""

STYLE = """
:root { --ink: #1d2330; --muted: #5b6475; --line: #d9dee7; --bg: #f6f7f9; --card: #fff;
  --accent: #2a5bd7; --red: #a3142b; --red-bg: #fde7ea; --amber: #7a4b00; --amber-bg: #fff1d6;
  --green: #1d6b34; --green-bg: #e3f4e8; --blue: #1f4fa8; --blue-bg: #e4ecfb;
  --grey: #454d5a; --grey-bg: #eceef2; }
* { box-sizing: border-box; }
html { font-size: 15px; }
body { margin: 0; font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: var(--ink); background: var(--bg); line-height: 1.45; }
a { color: var(--accent); } a:hover { text-decoration-thickness: 2px; }
code, .id, pre, kbd { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace;
  font-size: .92em; }
.id { overflow-wrap: anywhere; }
header.top { position: sticky; top: 0; z-index: 2; display: flex; align-items: center;
  gap: 1.2rem; padding: .55rem 1.5rem; background: #19202e; color: #fff; flex-wrap: wrap; }
header.top .brand { font-weight: 700; letter-spacing: .02em; }
header.top nav a { color: #dbe4ff; text-decoration: none; margin-right: 1rem;
  padding: .2rem 0; border-bottom: 2px solid transparent; }
header.top nav a.active { color: #fff; border-bottom-color: #8fb0ff; }
header.top .pill { background: var(--red); color: #fff; border-radius: 1em; padding: 0 .5em;
  font-size: .85em; margin-left: .3em; } header.top .pill.zero { background: #3b465c; }
header.top form { margin-left: auto; display: flex; gap: .4rem; }
header.top input { width: 22rem; max-width: 40vw; }
#status { color: #aeb8cc; font-size: .85em; }
main { max-width: 1500px; margin: 0 auto; padding: 1rem 1.5rem 3rem; }
#message { min-height: 0; margin: .4rem 0; }
#message:not(:empty) { padding: .5rem .8rem; border-radius: 6px; background: var(--green-bg);
  color: var(--green); border: 1px solid #b9dcc4; }
#message.err:not(:empty) { background: var(--red-bg); color: var(--red); border-color: #f1b8c1; }
h1 { font-size: 1.45rem; margin: .6rem 0 .3rem; display: flex; gap: .5rem; align-items: center;
  flex-wrap: wrap; }
h2 { font-size: 1.12rem; margin: 1.6rem 0 .5rem; } h3 { font-size: .8rem; margin: 0 0 .3rem;
  text-transform: uppercase; letter-spacing: .05em; color: var(--muted); }
.count { background: var(--red); color: #fff; border-radius: 1em; padding: 0 .55em;
  font-size: .9rem; }
.summary { color: var(--muted); margin: 0 0 .8rem; }
.muted { color: var(--muted); } .err { color: var(--red); } .grow { flex: 1; }
.empty { padding: 1.5rem; background: var(--card); border: 1px solid var(--line);
  border-radius: 8px; font-size: 1.05rem; }
.badge { display: inline-block; padding: .05em .5em; border-radius: 4px; font-weight: 650;
  font-size: .8rem; letter-spacing: .02em; border: 1px solid transparent;
  background: var(--grey-bg); color: var(--grey); white-space: nowrap; }
.s-UNKNOWN, .s-NEEDS_ATTENTION, .s-FAILED { background: var(--red-bg); color: var(--red);
  border-color: #f1b8c1; }
.s-IN_DOUBT, .s-PENDING, .s-RECALLING, .s-TERMINATING { background: var(--amber-bg);
  color: var(--amber); border-color: #f0d49a; }
.s-COMPLETED, .s-SUCCEEDED, .s-RECALLED, .s-RECONCILED, .s-NOT_APPLIED {
  background: var(--green-bg); color: var(--green); border-color: #b9dcc4; }
.s-RUNNING { background: var(--blue-bg); color: var(--blue); border-color: #bccdf2; }
.item { background: var(--card); border: 1px solid var(--line); border-left: 4px solid
  var(--red); border-radius: 8px; padding: .8rem 1rem; margin: 0 0 1rem; }
.item.st-COMPLETED, .item.st-NOT_APPLIED { border-left-color: #5fae78; }
.item.st-PENDING, .item.st-IN_DOUBT { border-left-color: #d9a23b; }
.item > header { display: flex; gap: .5rem; align-items: baseline; flex-wrap: wrap; }
.item .tool { font-size: 1.08rem; }
.item p { margin: .35rem 0; }
.why { background: #fafbfc; border-radius: 6px; padding: .4rem .6rem; }
.said { display: block; color: var(--muted); margin-top: .15rem; }
.facts { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: .8rem;
  margin: .6rem 0; }
.facts section { background: #fafbfc; border: 1px solid #eceff4; border-radius: 6px;
  padding: .45rem .6rem; min-width: 0; }
dl.kv { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: .1rem .8rem;
  margin: 0; }
dl.kv dt { color: var(--muted); } dl.kv dd { margin: 0; font-family: ui-monospace, Menlo,
  Consolas, monospace; font-size: .92em; overflow-wrap: anywhere; white-space: pre-wrap; }
dl.summary-list dd { font-family: inherit; font-size: 1em; }
pre.json { margin: 0; white-space: pre-wrap; overflow-wrap: anywhere; }
.cut { color: var(--amber); font-family: system-ui, sans-serif; }
fieldset { border: 1px solid var(--line); border-radius: 6px; padding: .5rem .8rem .7rem;
  margin: .6rem 0 0; display: flex; flex-wrap: wrap; gap: .5rem 1rem; align-items: end; }
legend { font-weight: 650; padding: 0 .3rem; }
fieldset .choices { display: flex; gap: 1.2rem; flex-basis: 100%; flex-wrap: wrap; }
fieldset .rule, fieldset .help { flex-basis: 100%; margin: 0; color: var(--muted);
  font-size: .93em; }
.rule.warn { color: var(--amber); }
label { display: inline-flex; flex-direction: column; gap: .15rem; font-size: .9rem;
  color: var(--muted); }
label.choice { flex-direction: row; align-items: center; gap: .35rem; color: var(--ink); }
label.wide { flex: 1 1 28rem; }
input, select, button { font: inherit; font-size: .95rem; }
input[type=text], input[type=number], select { padding: .3rem .45rem; border: 1px solid
  #b9c1ce; border-radius: 5px; background: #fff; color: var(--ink); min-width: 0; }
input[aria-invalid=true] { border-color: var(--red); outline: 2px solid var(--red-bg); }
input.grace { width: 6rem; }
button { padding: .35rem .9rem; border-radius: 5px; border: 1px solid var(--accent);
  background: var(--accent); color: #fff; cursor: pointer; }
button.danger { background: #fff; color: var(--red); border-color: var(--red); }
button:disabled { opacity: .6; cursor: progress; }
form.stop { background: var(--card); border-radius: 8px; margin: 1rem 0; }
form.stop fieldset { border-color: #f0d49a; background: #fffcf4; }
form.filters { display: flex; flex-wrap: wrap; gap: .5rem .8rem; align-items: end;
  background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  padding: .6rem .8rem; margin: .4rem 0 .8rem; }
form.filters label.time input { width: 16rem; } form.filters label.search { flex: 1 1 16rem; }
form.filters .clear { align-self: center; }
.scroll { overflow-x: auto; background: var(--card); border: 1px solid var(--line);
  border-radius: 8px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; vertical-align: top; padding: .4rem .6rem;
  border-bottom: 1px solid #edf0f4; }
th { font-size: .8rem; text-transform: uppercase; letter-spacing: .04em; color: var(--muted);
  background: #fafbfc; white-space: nowrap; }
tbody tr:hover { background: #f7f9fd; }
table.list td { font-size: .93rem; } code.key { font-size: .85em; overflow-wrap: anywhere; }
td code.id, td a.id, .stamp { white-space: nowrap; overflow-wrap: normal; }
nav.pager { display: flex; gap: 1rem; align-items: center; margin: .7rem 0; }
nav.pager span { color: var(--muted); margin-right: auto; }
nav.pager a { padding: .25rem .8rem; border: 1px solid var(--line); border-radius: 5px;
  background: var(--card); text-decoration: none; }
.cols { display: grid; grid-template-columns: minmax(0, 3fr) minmax(0, 2fr); gap: 1rem; }
.cols > section { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  padding: .7rem 1rem; min-width: 0; }
.side-col h2:first-child { margin-top: 0; }
ul.tree, ul.tree ul { list-style: none; margin: 0; padding-left: 1.1rem; }
ul.tree { padding-left: 0; } ul.tree li { margin: .2rem 0; }
ul.tree ul { border-left: 1px dashed #c3cad6; }
.here { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .92em; }
.held { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: .4rem .7rem; }
.chain ul { margin: .3rem 0 0; }
@media (max-width: 1100px) {
  .facts { grid-template-columns: minmax(0, 1fr); }
  .cols { grid-template-columns: minmax(0, 1fr); }
  header.top input { width: 14rem; }
}
"""
