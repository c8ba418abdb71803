"""A child that stopped to wait for a person's input (LangGraph's ``interrupt()``, say).

Its attempt ends INTERRUPTED with the questions as its result; ``Handle.redelegate(resume=...)``
runs the task on with the answers, passed to the agent as its ``resume`` keyword argument
(a mapping from question id to answer). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether._core.errors import UserError

_TAG = "interrupted"


@dataclass(frozen=True)
class Interrupted:
    """What an interrupted task asks: each question's id and value (JSON)."""

    questions: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {_TAG: dict(self.questions)}

    @classmethod
    def from_json(cls, data: Any) -> Interrupted | None:
        """The questions a stored result holds, or None if it holds none."""
        if (isinstance(data, dict) and set(data) == {_TAG} and isinstance(data[_TAG], dict)
                and data[_TAG] and all(isinstance(k, str) for k in data[_TAG])):
            return cls(data[_TAG])
        return None

    def answers(self, resume: Any) -> dict[str, Any]:
        """The answers ``resume`` gives: the value itself for the one question, or for several
        a mapping from (some of) their ids to answers."""
        if len(self.questions) == 1:
            return {next(iter(self.questions)): resume}
        ids = ", ".join(self.questions)
        if not isinstance(resume, Mapping) or not resume or not set(resume) <= set(self.questions):
            raise UserError(f"the task waits on several questions ({ids}): resume with a "
                            "mapping from their ids to the answers")
        return dict(resume)
