"""tether: recall, terminate and reconcile sub-agents whose tools have real side effects.

What an application builds with, reads or catches is here. Every error is in
``tether.errors``; the signed documents, the pure decisions and the seams under the API are in
``tether.protocol``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from tether import errors, protocol
from tether._core.errors import (
    DelegationError,
    Fenced,
    Recalled,
    Terminated,
    TetherError,
    ToolRejected,
)
from tether._core.model import ActionState, DelegationState, Effect, Policy, ProbeOutcome
from tether._core.redispatch import RedispatchPolicy, StreamCut
from tether._core.report import ActionRecord, Report
from tether._core.waiting import Interrupted
from tether._journal.journal import Journal
from tether._runtime.gateway import Context
from tether._runtime.handle import Handle
from tether._runtime.keys import KeyRing
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent, ProbeResult, Tool, agent, tool
from tether._runtime.worker import Worker

__version__ = "0.1.0"

__all__ = [
    "ActionRecord", "ActionState", "Agent", "Context", "DelegationError", "DelegationState",
    "Effect", "Fenced", "Handle", "Interrupted", "Journal", "KeyRing",
    "Policy", "ProbeOutcome", "ProbeResult", "Recalled", "RedispatchPolicy", "Report",
    "StreamCut", "Supervisor", "Terminated", "TetherError", "Tool", "ToolRejected",
    "Worker", "__version__", "agent", "errors", "protocol", "tool",
]

# Names that were here before they moved: still found, with a warning naming the new place.
_MOVED = {**{n: errors for n in errors.__all__ if n not in __all__},
          **{n: protocol for n in protocol.__all__ if n not in __all__}}


if not TYPE_CHECKING:
    # At run time only: to a type checker the moved names are gone (an error that names the
    # attribute), rather than every ``tether.<anything>`` typed as Any.
    def __getattr__(name: str) -> Any:
        home = _MOVED.get(name)
        if home is None:
            raise AttributeError(f"module 'tether' has no attribute {name!r}")
        warnings.warn(f"tether.{name} moved to {home.__name__}.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(home, name)

    def __dir__() -> list[str]:
        return sorted({*globals(), *_MOVED})
