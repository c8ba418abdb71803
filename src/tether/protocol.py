"""The protocol under the API, for those who verify, extend or simulate it: the signed
documents and their keys, the pure decisions (recall, re-dispatch) with their inputs and
verdicts, the enums they speak in, and the seams (a clock, the journal's default URL, the hooks
a supervisor calls and the event they receive)."""

from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt
from tether._core.errors import ControlSignal
from tether._core.model import ControlKind
from tether._core.redispatch import (
    UNRESTRICTED,
    AttemptFacts,
    Code,
    CutReason,
    Ending,
    Partial,
    RedispatchDecision,
    decide_redispatch,
)
from tether._core.signing import Signed, SigningKey, TrustedKeys
from tether._core.verdict import JournalFacts, RecallDecision, RecallInput, Verdict, evaluate_recall
from tether._journal.journal import DEFAULT_URL
from tether._runtime.clock import Clock, SystemClock
from tether._runtime.telemetry import HookEvent, Hooks

__all__ = [
    "DEFAULT_URL", "UNRESTRICTED", "Acknowledgement", "AttemptFacts", "Clock", "Code",
    "ControlIntent", "ControlKind", "ControlSignal", "CutReason", "Ending", "HookEvent", "Hooks",
    "JournalFacts", "NoEffectsReceipt", "Partial", "RecallDecision", "RecallInput",
    "RedispatchDecision", "Signed", "SigningKey", "SystemClock", "TrustedKeys", "Verdict",
    "decide_redispatch", "evaluate_recall",
]
