"""Probes named by ``module:attr`` in the MCP proxy's config files in the tests."""

from __future__ import annotations

import os
from pathlib import Path

import tether
from tests.mcp_helpers import paid


async def bank_pay(account: str, cents: int, *, idempotency_key: str) -> tether.ProbeResult:
    """Asks the bank's own ledger whether the payment with this key was applied."""
    rows = [r for r in paid(Path(os.environ["TETHER_TEST_LEDGER"]), account)
            if r[0] == idempotency_key]
    if rows:
        return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"ledger": rows[0][0]})
    return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"ledger": "no entry"})


def not_async(account: str) -> None:
    """Not a probe: probes are async functions."""
