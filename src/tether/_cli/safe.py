"""Terminal output that journal and user strings cannot subvert.

Everything the CLI prints through Rich is markup; any text that came from the journal, a tool,
a probe or the command line goes through ``safe`` first, so that ``[/bold]`` in a reason is
printed as typed instead of crashing the renderer, and an escape sequence or control character
in an agent's name is shown, visibly, instead of being sent to the terminal.
"""

from __future__ import annotations

import unicodedata
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


def _visible(ch: str) -> str:
    """Control and format characters (C0, C1, DEL, bidi overrides) as their escape codes."""
    if unicodedata.category(ch) in ("Cc", "Cf"):
        code = ord(ch)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    return ch


def plain(value: object) -> str:
    """The text of ``value`` with every control character made visible (no markup escaping:
    for output that Rich does not parse, e.g. ``markup=False`` or a ``Text``)."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(_visible(ch) for ch in text)


def safe(value: object) -> str:
    """``value`` as literal text inside Rich markup."""
    return escape(plain(value))


def when(ts: float | None) -> str:
    """A journal time as a UTC date and time (journals outlive a day)."""
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def age(ts: float | None, now: float) -> str:
    """How long ago, briefly: ``42s``, ``3m05s``, ``2h10m``, ``4d03h``."""
    if ts is None:
        return ""
    s = max(0, int(now - ts))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def id_column(table: Table, header: str, values: list[str] | None = None) -> None:
    """A column for ids and keys: never wrapped, never cut (ids of one process share a
    prefix, so a cut id cannot be told from its neighbours). ``print_table`` sizes it."""
    table.add_column(header, no_wrap=True, overflow="ignore")


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every unwrapped column (ids, keys, times, states) whole, even on a
    narrow terminal: its lines then run on (the terminal wraps them) rather than cut an id."""
    for column in table.columns:
        if column.no_wrap:
            cells = [Text.from_markup(c) if isinstance(c, str) else c for c in column.cells]
            column.min_width = max([_widest(Text.from_markup(str(column.header))),
                                    *(_widest(c) for c in cells if isinstance(c, Text))])
    need = Measurement.get(console, console.options.update_width(100_000), table).minimum
    if need <= console.width:
        console.print(table)
        return
    saved = console.width
    console.width = need
    try:
        console.print(table, crop=False)
    finally:
        console.width = saved


def _widest(text: Text) -> int:
    """The width of a cell's longest line (a stacked cell holds several)."""
    return max(line.cell_len for line in text.split("\n"))


def stacked(first: str, *more: str) -> str:
    """Markup for a cell of several lines, the first plain and the others dim (an id and what
    belongs with it, e.g. an action's delegation and key): a table stays within the terminal
    without cutting any of them."""
    return "\n".join([first, *(f"[dim]{m}[/dim]" for m in more if m)])


def clip(value: object, width: int = 60) -> str:
    """``value`` as compact JSON on one line, at most ``width`` characters: longer ends in
    ``…`` (``--json`` has it whole). Unescaped."""
    import json

    # In the order the call gave them: its first arguments are the ones that name things.
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(plain(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


def brief(evidence: dict[str, Any] | None) -> str:
    """Evidence as ``key=value`` pairs (the probe's times left out), unescaped."""
    if not evidence:
        return ""
    parts = []
    for k, v in evidence.items():
        if k == "resolution" and isinstance(v, dict):
            parts.append(f"decided {v.get('outcome')} by {v.get('operator')}: {v.get('note')}")
        elif k not in ("probed_at", "asked_at"):
            parts.append(f"{k}={v}")
    return ", ".join(parts)
