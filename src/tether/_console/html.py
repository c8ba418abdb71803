"""Pieces every view of the console is built from. Every journal string passes through ``e``
(escaped for text and attributes alike) before it reaches the page; the page's policy lets no
inline script or handler run even if one slipped through."""

from __future__ import annotations

import json
import time
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

# Past this, a value is cut with a marker; ``tether show --json`` has it whole.
LONG = 1200


def e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def href(path: str, **query: str | None) -> str:
    params = {k: v for k, v in query.items() if v}
    return e(path + ("?" + urlencode(params) if params else ""))


def d_href(delegation_id: str) -> str:
    return e("/d/" + quote(delegation_id, safe=""))


def badge(state: str) -> str:
    """A state in colour and in words (never colour alone)."""
    return f'<span class="badge s-{e(state)}">{e(state)}</span>'


def ident(value: str, cls: str = "id") -> str:
    return f'<code class="{cls}">{e(value)}</code>'


def link(delegation_id: str) -> str:
    return f'<a class="id" href="{d_href(delegation_id)}">{e(delegation_id)}</a>'


def utc(ts: float | None, ms: bool = False) -> str:
    if ts is None:
        return ""
    try:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        # Not a moment any calendar shows (1e300, NaN, a year past 9999): a number an agent
        # or a tool put in its arguments or result, shown as it is, never a failed view.
        return str(ts)
    frac = f".{int(ts % 1 * 1000):03d}" if ms else ""
    return stamp + frac + "Z"


def ago(ts: float | None, now: float) -> str:
    if ts is None:
        return ""
    s = int(max(0.0, now - ts))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m ago"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m ago"
    return f"{s // 86400}d ago"


def when(ts: float | None, now: float) -> str:
    """A time as its age, the exact UTC time on hover and for a screen reader."""
    if ts is None:
        return '<span class="muted">never</span>'
    return f'<time datetime="{e(utc(ts))}" title="{e(utc(ts))}">{e(ago(ts, now))}</time>'


def _text(value: Any, *, indent: int | None = None) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=indent, sort_keys=True, default=str, ensure_ascii=False)


def cut(text: str, limit: int = LONG) -> str:
    if len(text) <= limit:
        return e(text)
    return (e(text[:limit]) + f'<span class="cut"> [... {len(text) - limit} more characters; '
            'tether show --json has them all]</span>')


def value(v: Any, empty: str = "none") -> str:
    """Arguments, a result or evidence: a mapping as name/value rows, anything else as
    JSON, long text cut with a marker."""
    if v is None or v == {} or v == []:
        return f'<span class="muted">{e(empty)}</span>'
    if isinstance(v, dict):
        rows = "".join(f"<dt>{e(k)}</dt><dd>{_entry(k, x)}</dd>" for k, x in v.items())
        return f'<dl class="kv">{rows}</dl>'
    return f'<pre class="json">{cut(_text(v, indent=1))}</pre>'


def _entry(name: object, x: Any) -> str:
    # Evidence stamps its moments in seconds since the epoch: shown as times.
    if str(name).endswith("_at") and isinstance(x, int | float) and not isinstance(x, bool):
        return e(utc(x))
    return cut(_text(x, indent=1 if isinstance(x, dict | list) else None))


def brief(v: Any, limit: int = 120) -> str:
    """A value on one line, for a table cell."""
    if v is None or v == {}:
        return '<span class="muted">none</span>'
    text = (", ".join(f"{k}={_text(x)}" for k, x in v.items()) if isinstance(v, dict)
            else _text(v))
    return e(text if len(text) <= limit else text[:limit] + " ...")


def table(head: list[str], rows: list[list[str]], cls: str = "", testid: str = "") -> str:
    """Cells are HTML already (built from ``e`` and the helpers above)."""
    if not rows:
        return '<p class="muted">none</p>'
    th = "".join(f"<th>{e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    tid = f' data-testid="{e(testid)}"' if testid else ""
    return (f'<div class="scroll"><table class="{e(cls)}"{tid}><thead><tr>{th}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def problem(text: str) -> str:
    return f'<p class="err" role="alert">{e(text)}</p>'
