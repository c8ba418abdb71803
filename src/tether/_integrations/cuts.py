"""Whether a model call failed in transit, for adapters whose model client is not known.

A transport library's exception can only be raised once that library is imported, so its
classes are looked up in ``sys.modules`` instead of imported: no adapter depends on them."""

from __future__ import annotations

import sys

from tether._core.redispatch import CutReason

# (module, connect timeout, connect error, other transport error), most specific first
_CLASSES = (
    ("httpx2", "ConnectTimeout", "ConnectError", "TransportError"),
    ("httpx", "ConnectTimeout", "ConnectError", "TransportError"),
    ("openai", "APITimeoutError", "APIConnectionError", None),
)


def cut_reason(exc: BaseException) -> CutReason | None:
    """How a model call failed in transit, or None when it failed for another reason."""
    for module, timeout, connect, transport in _CLASSES:
        mod = sys.modules.get(module)
        if mod is None:
            continue
        for name, reason in ((timeout, CutReason.CONNECT_TIMEOUT),
                             (connect, CutReason.CONNECT_ERROR),
                             (transport, CutReason.STREAM_INCOMPLETE)):
            cls = getattr(mod, name, None) if name else None
            if isinstance(cls, type) and isinstance(exc, cls):
                return reason
    if isinstance(exc, ConnectionRefusedError):
        return CutReason.CONNECT_ERROR
    if isinstance(exc, ConnectionError):
        return CutReason.STREAM_INCOMPLETE  # the stream started, then broke
    return None
