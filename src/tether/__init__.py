"""tether: recall, terminate and reconcile sub-agents whose tools have real side effects."""

from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt
from tether._core.errors import (
    AlreadyFinished,
    BadSignature,
    ControlRefused,
    ControlSignal,
    DelegationError,
    Fenced,
    IdempotencyConflict,
    InvalidTransition,
    JournalCorrupt,
    JournalError,
    JournalLocked,
    KeyInUse,
    Malformed,
    NotAJournal,
    NotFound,
    Recalled,
    SchemaTooNew,
    StaleEpoch,
    StaleSequence,
    Terminated,
    TetherError,
    ToolRejected,
    UnknownKey,
    UserError,
)
from tether._core.model import (
    ActionState,
    ControlKind,
    DelegationState,
    Effect,
    Policy,
    ProbeOutcome,
)
from tether._core.report import ActionRecord, Report
from tether._core.signing import Signed, SigningKey, TrustedKeys
from tether._core.verdict import (
    JournalFacts,
    RecallDecision,
    RecallInput,
    Verdict,
    evaluate_recall,
)
from tether._journal.journal import DEFAULT_URL, Journal
from tether._runtime.clock import Clock, SystemClock
from tether._runtime.gateway import Context
from tether._runtime.handle import Handle
from tether._runtime.keys import KeyRing
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent, ProbeResult, Tool, agent, tool

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_URL",
    "Acknowledgement",
    "ActionRecord",
    "ActionState",
    "Agent",
    "AlreadyFinished",
    "BadSignature",
    "Clock",
    "Context",
    "ControlIntent",
    "ControlKind",
    "ControlRefused",
    "ControlSignal",
    "DelegationError",
    "DelegationState",
    "Effect",
    "Fenced",
    "Handle",
    "IdempotencyConflict",
    "InvalidTransition",
    "Journal",
    "JournalCorrupt",
    "JournalError",
    "JournalFacts",
    "JournalLocked",
    "KeyInUse",
    "KeyRing",
    "Malformed",
    "NoEffectsReceipt",
    "NotAJournal",
    "NotFound",
    "Policy",
    "ProbeOutcome",
    "ProbeResult",
    "RecallDecision",
    "RecallInput",
    "Recalled",
    "Report",
    "SchemaTooNew",
    "Signed",
    "SigningKey",
    "StaleEpoch",
    "StaleSequence",
    "Supervisor",
    "SystemClock",
    "Terminated",
    "TetherError",
    "Tool",
    "ToolRejected",
    "TrustedKeys",
    "UnknownKey",
    "UserError",
    "Verdict",
    "__version__",
    "agent",
    "evaluate_recall",
    "tool",
]
