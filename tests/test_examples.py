"""Every example in examples/ runs offline, as written, and shows what it promises."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


async def run_example(name: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / name), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


@pytest.mark.parametrize(("name", "expected"), [
    ("mcp_gateway.py", ["outcome: RECALLED", "bank.pay alice: COMPLETED", "bank ledger: alice\n"]),
    ("openai_agents_refund.py", ["result: Refunded 12.50 on A-1001.", "attempts: 2",
                                 "SUCCEEDED, [('refund', 'COMPLETED')]",
                                 "provider ledger: [('A-1001', 1250)]"]),
    ("langgraph_refund.py", ["result: Refunded 12.50 on A-1001.", "attempts: 2",
                             "SUCCEEDED, [('refund', 'COMPLETED')]",
                             "provider ledger: [('A-1001', 1250)]"]),
    ("pydantic_ai_refund.py", ["result: Refunded 12.50 on A-1001.",
                               "SUCCEEDED: [('refund', 0, 'FAILED'), "
                               "('refund', 1250, 'COMPLETED')]",
                               "provider ledger: [('A-1001', 1250)]"]),
    ("workers.py", ["queued task result: report on weekly numbers",
                    "recalled on the worker: RECALLED"]),
    ("temporal_refund.py", ["naive Temporal: cancelled, run again; refunds applied: 2",
                            "with tether: RECALLED [('refund', 'COMPLETED')], run again; "
                            "refunds applied: 1"]),
])
async def test_example_runs_offline(name: str, expected: list[str]) -> None:
    out = await run_example(name)
    for line in expected:
        assert line in out, out
