"""Recording a person's decision on an action (``tether resolve``, ``Supervisor.resolve``):
sign a Resolution with the operator's key and name, and have the journal record it."""

from __future__ import annotations

import getpass
import os

from tether._core.errors import UserError
from tether._core.model import ActionState
from tether._core.report import ActionRecord
from tether._core.resolution import DECISIONS, Resolution
from tether._journal.journal import Journal
from tether._runtime.keys import KeyRing


def operator_name() -> str:
    """Who is deciding, unless told: $TETHER_OPERATOR, else the login name."""
    name = os.environ.get("TETHER_OPERATOR", "")
    if name:
        return name
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name (a container without a passwd entry)
        return f"uid {os.getuid()}"


# A name is for people reading an audit; a page of text is not a name.
NAME_LIMIT = 200


def operator_of(by: str | None) -> str:
    """Who decides or asks: ``by`` if given, else $TETHER_OPERATOR, else the login name."""
    who = operator_name() if by is None else by
    if not isinstance(who, str) or not who.strip():
        raise UserError("name who decides or asks (--by NAME, or set $TETHER_OPERATOR)")
    if len(who) > NAME_LIMIT:
        raise UserError(f"--by takes a name of at most {NAME_LIMIT} characters")
    return who.strip()


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
