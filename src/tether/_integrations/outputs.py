"""The structured output of a framework built on pydantic (pydantic-ai, the OpenAI Agents SDK):
an agent declared with ``output_type=Refund`` ends its run with a ``Refund``, which is not
JSON. The journal keeps pydantic's JSON of it (``dump_python(mode="json")``, what both
frameworks use to show the model its own schema), and ``Handle.result`` gives the ``Refund``
rebuilt from that JSON with the declared type, in this process and in any other that reads
the journal. A value whose JSON does not rebuild an equal value (a field left out of the
JSON, a validator that changes it) is refused with a ``UserError`` naming the difference,
never handed back altered."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Union

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from tether._core import values
from tether._core.errors import UserError


def _label(form: Any) -> str:
    return getattr(form, "__name__", None) or repr(form)


class TypedOutput:
    """Output of one of the declared types (a union when there are several)."""

    def __init__(self, types: Sequence[Any]) -> None:
        forms = list(dict.fromkeys(types))  # in order, once each
        form: Any = forms[0] if len(forms) == 1 else Union[tuple(forms)]  # noqa: UP007
        self.label = " | ".join(_label(f) for f in forms)
        self._adapter: TypeAdapter[Any] = TypeAdapter(form)

    def dump(self, value: Any) -> Any:
        try:
            # warnings="error": a value that is not of the declared type is refused, not
            # serialized by guesswork that the rebuild would then misread.
            stored = self._adapter.dump_python(value, mode="json", warnings="error")
        except (PydanticSerializationError, ValueError, TypeError) as exc:
            raise UserError(f"{type(value).__name__} is not of its declared output type "
                            f"{self.label}: {exc}") from None
        rebuilt = self.load(stored)
        if type(rebuilt) is not type(value) or rebuilt != value:
            raise UserError(f"its JSON {json.dumps(stored)[:300]} does not give back the "
                            f"{type(value).__name__} it returned: output type {self.label} "
                            f"rebuilds {rebuilt!r:.300}")
        return stored

    def load(self, stored: Any) -> Any:
        try:
            # JSON mode: the stored value is JSON, whichever process reads it.
            return self._adapter.validate_json(json.dumps(stored))
        except ValidationError as exc:
            raise UserError(f"the stored output does not validate as {self.label}: "
                            f"{exc}") from None


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
            raise UserError(f"{type(value).__name__} has no JSON form: {exc}") from None

    def load(self, stored: Any) -> Any:
        return stored


def output_codec(types: Sequence[Any] | None) -> TypedOutput | JsonOutput | None:
    """The codec for an agent declaring ``types`` (None: a type tether cannot rebuild), or
    None when its output is text, stored as it is."""
    if types is None:
        return JsonOutput()
    if all(t is str for t in types):
        return None
    return TypedOutput(types)
