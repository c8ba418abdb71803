"""Recording a person's decision on an action (``tether resolve``, ``Supervisor.resolve``):
sign a Resolution with the operator's key and name, and have the journal record it."""

from __future__ import annotations

import getpass
import os
import unicodedata

from tether._core.errors import UserError
from tether._core.model import ActionState
from tether._core.report import ActionRecord
from tether._core.resolution import DECISIONS, Resolution
from tether._journal.journal import Journal
from tether._runtime.keys import KeyRing


def operator_name() -> str:
    """Who is deciding, unless told: $TETHER_OPERATOR (unless blank), else the login name."""
    name = os.environ.get("TETHER_OPERATOR", "")
    if name.strip():
        return _checked(name, "$TETHER_OPERATOR")
    try:
        login = getpass.getuser()  # $LOGNAME, $USER, ... first: anyone may set those
    except (OSError, KeyError):  # no login name (a container without a passwd entry)
        return f"uid {os.getuid()}"
    return _checked(login, "the login name ($LOGNAME or $USER)",
                    " (or name who decides with --by or $TETHER_OPERATOR)")


# A name is for people reading an audit; a page of text is not a name.
NAME_LIMIT = 200
# Control, format (bidi overrides, zero-width), surrogate, private, unassigned, and line or
# paragraph separators: what would hide a name, fake another, or break a log line.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Letters and marks that render as nothing (Unicode's default-ignorable fillers, variation
# selectors, the grapheme joiner, the braille blank): a name of them looks blank, or like
# another name.
_INVISIBLE = frozenset(
    {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x2800, 0x3164, 0xFFA0,
     *range(0x180B, 0x1810), *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)})
# Combining marks in a row on one letter: a few make any script's letters; more stack
# into a glyph that overruns the lines around it.
_MARKS_IN_A_ROW = 4


def _checked(name: str, source: str, instead: str = "") -> str:
    marks = 0
    for c in name:
        marks = marks + 1 if unicodedata.category(c).startswith("M") else 0
        if unicodedata.category(c) in _HIDDEN or ord(c) in _INVISIBLE or \
                marks > _MARKS_IN_A_ROW:
            raise UserError(f"{source} holds a control, invisible or stacked character: "
                            f"give a name people can read{instead}")
    name = name.strip()
    if name and unicodedata.category(name[0]).startswith("M"):
        raise UserError(f"{source} begins with a combining mark: give a name people can "
                        f"read{instead}")
    if not name:
        raise UserError(f"{source} is blank: name who decides or asks{instead}")
    if len(name) > NAME_LIMIT:
        raise UserError(f"{source} takes a name of at most {NAME_LIMIT} characters{instead}")
    return name


def operator_of(by: str | None) -> str:
    """Who decides or asks: ``by`` if given, else $TETHER_OPERATOR, else the login name."""
    if by is None:
        return operator_name()
    if not isinstance(by, str):
        raise UserError("--by takes a name")
    return _checked(by, "--by")


def decision(value: ActionState | str) -> ActionState:
    try:
        outcome = ActionState(value)
    except ValueError:
        outcome = None
    if outcome not in DECISIONS:
        raise UserError(f"decide COMPLETED or NOT_APPLIED, not {value!r}")
    assert outcome is not None
    return outcome


async def resolve(journal: Journal, keys: KeyRing, action_id: str, outcome: ActionState | str,
                  note: str, operator: str | None, now: float) -> ActionRecord:
    decided = decision(outcome)
    if not isinstance(note, str) or not note.strip():
        raise UserError("a decision needs a note saying why (--note)")
    who = operator_of(operator)
    action = await journal.action(action_id)
    if journal.signer is None:  # this process's writes are sealed with its key
        journal.seal_with(keys.signer, keys.trusted)
    signed = keys.signer.sign(Resolution(
        action_id=action.id, delegation_id=action.delegation_id, outcome=decided, note=note,
        operator=who, issued_at=now))
    return await journal.resolve(signed, keys.trusted, now)
