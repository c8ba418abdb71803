"""Every error tether raises. The ones an application catches or raises itself (``TetherError``,
``DelegationError``, ``Fenced``, ``Recalled``, ``Terminated``, ``ToolRejected``, ``StreamCut``,
``UserError``) are also at ``tether``."""

from tether._core.errors import (
    AlreadyFinished,
    BadSignature,
    ClockSkew,
    ControlRefused,
    DelegationError,
    Fenced,
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
    Recalled,
    SchemaTooNew,
    StaleEpoch,
    StaleSequence,
    Tampered,
    Terminated,
    TetherError,
    ToolRejected,
    UnknownKey,
    UserError,
)
from tether._core.redispatch import CeilingReached, StreamCut

__all__ = [
    "AlreadyFinished", "BadSignature", "CeilingReached", "ClockSkew", "ControlRefused",
    "DelegationError", "Fenced", "IdempotencyConflict", "InvalidTransition",
    "JournalCorrupt", "JournalError", "JournalLocked", "KeyInUse", "LeaseLost", "Malformed",
    "NotAJournal", "NotFound", "Recalled", "SchemaTooNew", "StaleEpoch", "StaleSequence",
    "StreamCut", "Tampered", "Terminated", "TetherError", "ToolRejected", "UnknownKey",
    "UserError",
]
