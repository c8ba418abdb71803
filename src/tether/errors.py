"""Every error tether's API raises, and ``ControlSignal``: the base of ``Recalled``, ``Fenced`` and
``Terminated``, which stop a child and which ``except Exception`` does not catch. The ones an
application catches or raises itself (``TetherError``, ``DelegationError``, ``Fenced``,
``Recalled``, ``Terminated``, ``ToolRejected``, ``StreamCut``) are also at ``tether``;
``UserError``, a misuse of the API to fix rather than catch, is here only."""

from tether._core.errors import (
    AlreadyFinished,
    BadSignature,
    ClockSkew,
    ControlRefused,
    ControlSignal,
    DelegationError,
    Fenced,
    ForgedRow,
    IdempotencyConflict,
    InvalidTransition,
    JournalCorrupt,
    JournalError,
    JournalLocked,
    KeyInUse,
    LeaseLost,
    Malformed,
    NotAJournal,
    NotFound,
    OwnerChanged,
    Recalled,
    RedispatchCancelled,
    SchemaTooNew,
    StaleEpoch,
    StaleSequence,
    Tampered,
    Terminated,
    TetherError,
    ToolRejected,
    Unbound,
    UnknownKey,
    UserError,
    WorkRefused,
)
from tether._core.redispatch import CeilingReached, StreamCut

__all__ = [
    "AlreadyFinished", "BadSignature", "CeilingReached", "ClockSkew", "ControlRefused",
    "ControlSignal", "DelegationError", "Fenced", "ForgedRow", "IdempotencyConflict",
    "InvalidTransition", "JournalCorrupt", "JournalError", "JournalLocked", "KeyInUse",
    "LeaseLost", "Malformed", "NotAJournal", "NotFound", "OwnerChanged", "Recalled",
    "RedispatchCancelled", "SchemaTooNew", "StaleEpoch", "StaleSequence", "StreamCut",
    "Tampered", "Terminated", "TetherError", "ToolRejected", "Unbound", "UnknownKey",
    "UserError", "WorkRefused",
]
