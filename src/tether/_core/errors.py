"""tether's error families.

Three families, as in Trio and Temporal:

* ``UserError``: the caller misused tether (bad grace, unknown tool, arguments that cannot be
  serialized, a reused idempotency key). Nothing was changed.
* ``ControlRefused`` and ``JournalError``: a control intent or a journal was refused, with
  machine-readable fields. Nothing was changed.
* ``ControlSignal``: recall, terminate and fencing reach a child as exceptions derived from
  ``BaseException``, so ``except Exception`` in agent code cannot swallow them.
"""

from __future__ import annotations


class TetherError(Exception):
    """Base of every ordinary tether error."""


class UserError(TetherError):
    """The caller misused the API; nothing was changed."""


class IdempotencyConflict(UserError):
    """An idempotency key was reused with different arguments (the Stripe rule)."""

    def __init__(self, key: str, tool: str) -> None:
        super().__init__(
            f"idempotency key {key!r} was already used for {tool} with different arguments"
        )
        self.key = key
        self.tool = tool


class KeyInUse(TetherError):
    """An action with this idempotency key is in flight or its outcome is not yet known."""

    def __init__(self, key: str, action_id: str, state: str) -> None:
        super().__init__(
            f"idempotency key {key!r} belongs to action {action_id} whose state is {state}; "
            "it must be reconciled before the key can be used again"
        )
        self.key = key
        self.action_id = action_id
        self.state = state


class ControlRefused(TetherError):
    """A control intent was refused by the journal or the verifier; nothing was changed."""

    code = "refused"


class BadSignature(ControlRefused):
    code = "bad_signature"


class UnknownKey(ControlRefused):
    code = "unknown_key"


class Unbound(ControlRefused):
    """A signed intent is attached to a row it does not name (copied or replayed)."""

    code = "unbound"


class ForgedRow(ControlRefused):
    """A control row the journal's acceptance did not write holds the sequence asked for."""

    code = "forged_row"


class WorkRefused(ControlRefused):
    """Queued work whose signature is missing, untrusted or does not match its row."""

    code = "work_refused"


class StaleSequence(ControlRefused):
    """The intent's sequence number is not last+1 (I4)."""

    code = "stale_sequence"

    def __init__(self, delegation_id: str, offered: int, current: int) -> None:
        super().__init__(
            f"control sequence {offered} refused for {delegation_id}: current sequence is "
            f"{current}, the next intent must carry {current + 1}"
        )
        self.delegation_id = delegation_id
        self.offered = offered
        self.current = current


class OwnerChanged(ControlRefused):
    """A recovery's terminate for a delegation whose owner is no longer the one judged gone:
    a worker claimed it since (its liveness decides now, not the old owner's)."""

    code = "owner_changed"

    def __init__(self, delegation_id: str, judged: str | None, current: str | None) -> None:
        super().__init__(f"delegation {delegation_id} is now owned by {current}, not by "
                         f"{judged}, whose absence the recovery judged: left to its owner")
        self.delegation_id = delegation_id
        self.judged = judged
        self.current = current


class StaleEpoch(ControlRefused):
    """The caller's epoch is not the task's current epoch: someone re-delegated first."""

    code = "stale_epoch"

    def __init__(self, task_id: str, offered: int, current: int) -> None:
        super().__init__(
            f"epoch {offered} of task {task_id} is stale: the current epoch is {current}"
        )
        self.task_id = task_id
        self.offered = offered
        self.current = current


class InvalidTransition(ControlRefused):
    code = "invalid_transition"

    def __init__(self, delegation_id: str, state: str, wanted: str,
                 current: int | None = None) -> None:
        # ``current``: the control sequence, for an intent that lost to one accepted first
        # (I4: the loser of a race is told the current sequence).
        after = "" if current is None else \
            f" (current control sequence {current}: an intent was accepted before this one)"
        super().__init__(f"delegation {delegation_id} is {state}; it cannot go to {wanted}"
                         f"{after}")
        self.delegation_id = delegation_id
        self.state = state
        self.wanted = wanted
        self.current = current


class AlreadyFinished(InvalidTransition):
    """The delegation reached a terminal state before the intent arrived."""

    code = "already_finished"


class NotFound(UserError):
    """No delegation or action with that id in this journal."""


class JournalError(TetherError):
    """The journal cannot be used as asked; nothing was changed."""


class NotAJournal(JournalError):
    pass


class JournalCorrupt(JournalError):
    pass


class JournalLocked(JournalError):
    pass


class SchemaTooNew(JournalError):
    def __init__(self, found: int, supported: int) -> None:
        super().__init__(
            f"journal schema version {found} is newer than this tether supports ({supported}); "
            "upgrade tether"
        )
        self.found = found
        self.supported = supported


class Tampered(JournalError):
    """A delegation's records fail verification against its signed chain (altered, inserted
    or deleted by hand): reconciliation and re-delegation refuse to act on them; a person
    decides (``tether verify`` names each record)."""

    def __init__(self, message: str, problems: dict[str, list[str]]) -> None:
        super().__init__(message)
        self.problems = problems  # delegation id -> the records that fail


class LeaseLost(JournalError):
    """A worker's lease ran out before it could renew it (a long pause, a lost network): others
    may already have presumed it dead and reconciled its work, so it stops at once."""

    def __init__(self, owner_id: str, why: str = "its lease ran out") -> None:
        super().__init__(f"worker {owner_id} stopped: {why}; its delegations are reconciled "
                         "by others and its late actions are refused by the journal")
        self.owner_id = owner_id
        self.why = why


class ClockSkew(JournalError):
    """This host's wall clock is further off the journal server's than the policy's clock
    tolerance allows: dispatch deadlines it writes or judges could be misjudged, so the
    process refuses to start (or stops); nothing was changed by the refusal."""

    def __init__(self, offset: float, limit: float, what: str) -> None:
        super().__init__(f"{what}: this host's clock is {offset:+.1f} s off the journal "
                         f"server's, more than the {limit:g} s it may be (half the policy's "
                         "clock_tolerance); sync it with NTP")
        self.offset = offset
        self.limit = limit


class DelegationError(TetherError):
    """A delegated child failed; the fields say which and why."""

    def __init__(self, delegation_id: str, task_id: str, attempt: int, reason: str) -> None:
        super().__init__(
            f"delegation {delegation_id} (task {task_id}, attempt {attempt}): {reason}"
        )
        self.delegation_id = delegation_id
        self.task_id = task_id
        self.attempt = attempt
        self.reason = reason


class RedispatchCancelled(TetherError):
    """The task was cancelled while a re-dispatch was being prepared."""


class ToolRejected(TetherError):
    """Raised by a tool to say, with certainty, that its effect was not applied.

    Any other exception from a non-READ_ONLY tool leaves the action IN_DOUBT, to be probed.
    """


class ControlSignal(BaseException):
    """Stops a child. Derives from BaseException so ``except Exception`` cannot swallow it."""

    def __init__(self, delegation_id: str, message: str) -> None:
        super().__init__(message)
        self.delegation_id = delegation_id


class Recalled(ControlSignal):
    """The delegation was recalled: no new work may start."""


class Fenced(ControlSignal):
    """The journal refused a new action: the delegation is fenced or its epoch is stale."""


class Malformed(ControlRefused):
    """A signed document does not decode to a valid intent, acknowledgement or receipt."""

    code = "malformed"


class Terminated(ControlSignal):
    """The delegation was terminated."""
