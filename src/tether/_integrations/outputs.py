"""The structured output of a framework built on pydantic (pydantic-ai, the OpenAI Agents SDK):
an agent declared with ``output_type=Refund`` ends its run with a ``Refund``, which is not
JSON. The journal keeps pydantic's JSON of it, and ``Handle.result`` gives the ``Refund``
rebuilt from that JSON with the declared type, in this process and in any other that reads
the journal.

The JSON is by field name, not alias, with computed fields left out (``round_trip``), and is
read back by field name: so it rebuilds whatever aliases (``Field(alias=)``, an alias
generator, a validation alias unlike the serialization one) and ``extra="forbid"`` say. When
a run can end in more than one type (a union, handoffs to agents of other output types, a
tool's own output), the JSON alone cannot say which (two types with the same fields), so the
journal keeps ``{"type": <the member's name>, "value": <its JSON>}``, ``"type": null`` for a
plain value.

A value is stored only if its JSON gives it back: the rebuilt value is of the same type, its
own JSON is the stored JSON (a validator that changes the value is caught there), and, for a
type with value equality, it equals the value (a field the JSON leaves out is caught there).
Otherwise a one-line ``UserError`` says what differs; nothing is handed back altered."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, get_origin

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from tether._core import values
from tether._core.errors import UserError


def _label(form: Any) -> str:
    if get_origin(form) is not None:  # list[Inner]: a generic alias passes __name__ to list
        return repr(form).replace("typing.", "")
    return getattr(form, "__qualname__", None) or getattr(form, "__name__", None) or repr(form)


def one_line(exc: Exception) -> str:
    """pydantic's errors span lines (one per error, a link under each): one line of them."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                         for e in exc.errors(include_url=False))
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _shown(stored: Any) -> str:
    return f"{json.dumps(stored)[:300]}"


class _Member:
    """One declared output type."""

    def __init__(self, name: str, form: Any) -> None:
        self.name = name
        self._adapter: TypeAdapter[Any] = TypeAdapter(form)

    def json(self, value: Any) -> Any:
        # warnings="error": a value that is not of this type is refused, not serialized by
        # guesswork that the rebuild would then misread.
        return self._adapter.dump_python(value, mode="json", by_alias=False, round_trip=True,
                                         warnings="error")

    def load(self, stored: Any) -> Any:
        # JSON mode: the stored value is JSON, whichever process reads it; by name, as dumped.
        return self._adapter.validate_json(json.dumps(stored), by_alias=False, by_name=True)


_IDENTITY_EQ: Any = object.__eq__


class _Refused(Exception):
    """Why a value cannot be stored as one member: ``rank`` orders the reasons, the one from
    the member the value is most nearly of is the one reported."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _stored_as(member: _Member, value: Any, label: str) -> Any:
    kind = type(value).__name__
    try:
        stored = member.json(value)
    except (PydanticSerializationError, ValueError, TypeError) as exc:
        raise _Refused(0, f"{kind} is not of its declared output type {label}: "
                          f"{one_line(exc)}") from None
    try:
        values.check(stored)  # NaN or infinity: JSON has neither
    except UserError as exc:
        raise _Refused(3, str(exc)) from None
    try:
        rebuilt = member.load(stored)
    except ValidationError as exc:
        raise _Refused(2, f"its JSON {_shown(stored)} does not validate as {member.name}: "
                          f"{one_line(exc)}") from None
    if type(rebuilt) is not type(value):
        raise _Refused(1, f"{kind} is not of its declared output type {label}: it "
                          f"rebuilds as "
                          f"{type(rebuilt).__name__}")
    again = member.json(rebuilt)
    if again != stored:
        raise _Refused(2, f"its JSON {_shown(stored)} does not give back the {kind} it "
                          f"returned: rebuilt, its JSON is {_shown(again)} (a validator "
                          "that changes it?)")
    # A type without value equality (a dataclass with eq=False) compares by identity: its
    # JSON giving back that same JSON is then the check.
    if type(value).__eq__ is not _IDENTITY_EQ and rebuilt != value:
        raise _Refused(2, f"its JSON {_shown(stored)} does not give back the {kind} it "
                          f"returned: {member.name} rebuilds {rebuilt!r:.300} (a field "
                          "its JSON leaves out?)")
    return stored


class TypedOutput:
    """Output of one of the declared types, or with ``plain`` a value of no declared type (a
    tool's output that ended the run), kept as its JSON."""

    def __init__(self, types: Sequence[Any], *, plain: bool = False) -> None:
        forms = list(dict.fromkeys(types))  # in order, once each
        labels = [_label(f) for f in forms]
        names = [n if labels.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(labels)]
        self._members = [_Member(n, f) for n, f in zip(names, forms, strict=True)]
        self._tagged = len(forms) > 1 or plain
        self._plain = plain
        self.label = " | ".join(dict.fromkeys(labels))

    def dump(self, value: Any) -> Any:
        refused: list[_Refused] = []
        for member in self._members:
            try:
                stored = _stored_as(member, value, self.label)
            except _Refused as exc:
                refused.append(exc)
                continue
            return {"type": member.name, "value": stored} if self._tagged else stored
        if self._plain and all(r.rank <= 1 for r in refused):
            # Of none of the declared types (a tool's output): its JSON. A value of one that
            # does not round-trip is refused below, not kept as JSON that loses its type.
            return {"type": None, "value": JsonOutput().dump(value)}
        raise UserError(str(max(refused, key=lambda r: r.rank)))  # the first of the highest

    def load(self, stored: Any) -> Any:
        member = self._members[0]
        if self._tagged:
            if not (isinstance(stored, dict) and set(stored) == {"type", "value"}):
                raise UserError(f"the stored output is not a {{type, value}} pair of "
                                f"{self.label}: {_shown(stored)}")
            if stored["type"] is None and self._plain:
                return stored["value"]
            found = [m for m in self._members if m.name == stored["type"]]
            if not found:
                raise UserError(f"the stored output is a {stored['type']}, not one of "
                                f"{self.label}")
            member, stored = found[0], stored["value"]
        try:
            return member.load(stored)
        except ValidationError as exc:
            raise UserError(f"the stored output does not validate as {member.name}: "
                            f"{one_line(exc)}") from None


class JsonOutput:
    """Output whose type tether cannot rebuild (an SDK output schema of the user's own): the
    JSON pydantic gives of it, here as everywhere."""

    def dump(self, value: Any) -> Any:
        try:
            values.check(value)
            return value
        except UserError:
            pass
        try:
            return to_jsonable_python(value)
        except PydanticSerializationError as exc:
            raise UserError(f"{type(value).__name__} has no JSON form: "
                            f"{one_line(exc)}") from None

    def load(self, stored: Any) -> Any:
        return stored


def output_codec(types: Sequence[Any] | None, *,
                 plain: bool = False) -> TypedOutput | JsonOutput | None:
    """The codec for an agent declaring ``types`` (None: a type tether cannot rebuild), or
    None when its output is text, stored as it is. ``plain``: the run may also end in a value
    of none of them (an SDK agent stopping at a tool's output)."""
    if types is None:
        return JsonOutput()
    if all(t is str for t in types):
        return None
    return TypedOutput(types, plain=plain)
