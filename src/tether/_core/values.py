"""The one encoding of the values tether stores for its users: delegation arguments and
results, tool arguments and results. The same rules hold wherever the value goes (a child in
this process, a worker elsewhere, a replay after a crash), and a value is refused when it is
handed over, never found unstorable later.

What is stored is JSON, and reading it back gives the value that was given:

* ``None``, ``bool``, ``str`` (valid Unicode: no lone surrogate), ``int`` far beyond 2**53
  (JSON has no limit: 2**60 comes back as 2**60; up to ``MAX_INT_BITS`` bits), ``float`` when
  finite (written with ``repr``, so it comes back bit for bit);
* ``list`` and ``tuple`` (a tuple comes back as a list, as from any JSON store), ``dict``
  whose keys are strings.

Anything else is a ``UserError`` naming the first part that does not fit: a set, bytes, an
object, NaN or infinity, a dict with a non-string key (JSON would turn ``{1: "a"}`` into
``{"1": "a"}``), a cycle, or nesting deeper than ``MAX_DEPTH``. Subclasses of the types above
(an ``enum.StrEnum`` member, say) are stored as the plain value.

Signed control documents are another matter: they keep RFC 8785 canonical JSON
(``documents.canonical``), whose bytes their signatures cover. Only ids, numbers below 2**53
and strings go into those.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tether._core.errors import UserError

MAX_DEPTH = 200  # well inside the JSON decoder's recursion limit, so what is written is read
# Python refuses to convert integers of more than 4,300 digits to text by default (CVE-2020-
# 10735); bounded below that, so whatever process reads the value can parse it.
MAX_INT_BITS = 13_000  # about 3,900 decimal digits


# Stands for the result of a call that applied but returned something that cannot be stored:
# its completion is recorded all the same, and only a replay of its key (which would need the
# value) is refused.
UNSERIALIZABLE = "__tether_unserializable__"


def storable(value: Any) -> Any:
    """``value`` if it can be stored, else the UNSERIALIZABLE marker (for what has already
    happened and must be recorded whatever it returned: a tool's result, a probe's answer)."""
    try:
        check(value)
    except UserError:
        return {UNSERIALIZABLE: _short_repr(value)}
    return value


def _short_repr(value: Any) -> str:
    try:
        return repr(value)[:500]
    except Exception as exc:  # a repr that fails (a huge int, a broken __repr__)
        return f"<{type(value).__name__}: repr failed: {exc}>"[:500]


def check(value: Any) -> None:
    """Raise UserError if ``value`` would not come back from the journal as it was given."""
    _check(value, "value", 0)


def _check(value: Any, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise UserError(f"{where} is nested deeper than {MAX_DEPTH} levels (or contains "
                        "itself)")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise UserError(f"{where} is an integer of {value.bit_length()} bits; "
                            f"at most {MAX_INT_BITS} are stored")
        return
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{where} is a string that is not valid Unicode "
                            "(a lone surrogate)") from None
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UserError(f"{where} is {value!r}: JSON has no NaN or infinity")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UserError(f"{where} has a key {key!r} of type {type(key).__name__}: "
                                "JSON object keys are strings")
            _check(key, f"{where} key", depth + 1)
            _check(item, f"{where}[{key!r}]", depth + 1)
        return
    raise UserError(f"{where} is of type {type(value).__name__}, which JSON cannot carry")


def dumps(value: Any) -> str:
    """The stored text of a value (sorted keys, no spaces); UserError if it cannot be stored.
    Equal values give equal text, so the text can be hashed (the Stripe rule's argument
    check)."""
    check(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False,
                      ensure_ascii=False)


def loads(text: str) -> Any:
    return json.loads(text)
