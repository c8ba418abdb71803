"""Probes live with the deployment's configuration, not with one process: a supervisor or
``tether reconcile`` opened on a journal probes the calls an earlier process left in doubt
with the tools ``$TETHER_TOOLS`` names, adapter-built agents (and their sub-agents) included;
a tool nobody declared is said in one line, and a bad declaration is refused in one line."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

import tether
from tether.conformance import run_scenario

from .conftest import ONE_CLOCK
from .test_conformance import PydanticAi

ROOT = Path(__file__).resolve().parent.parent


async def killed_mid_payment(tmp_path: Path) -> tuple[str, str, dict[str, str]]:
    """A process runs tests.adapter_tools' pydantic-ai agent; the provider applies its
    sub-agent's refund; the process is killed before the reply comes."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    env = {**os.environ, "TETHER_TEST_LEDGER": str(tmp_path / "ledger.db"),
           "PYTHONPATH": os.pathsep.join((str(ROOT), os.environ.get("PYTHONPATH", "")))}
    env.pop("TETHER_TOOLS", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.adapter_tools", journal, env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode().split()
    assert line and line[0] == "applied", line
    proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL
    return journal, line[1], env


async def reconcile(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "reconcile", *args, env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_reconcile_uses_the_tools_tether_tools_names(tmp_path: Path) -> None:
    journal, delegation, env = await killed_mid_payment(tmp_path)
    code, out, err = await reconcile({**env, "TETHER_TOOLS": "tests.adapter_tools:child"},
                                     "--journal", journal, "--json")
    assert code == 0, err
    (report,) = json.loads(out)
    assert report["delegation"] == delegation
    (sub,) = report["children"]  # the refund ran in the sub-agent
    (action,) = sub["actions"]
    assert action["tool"] == "refund" and action["state"] == "COMPLETED", report
    assert action["evidence"]["probe"] == "COMPLETED"
    assert report["outcome"] != "NEEDS_ATTENTION" and sub["outcome"] == "RECONCILED"
    assert "warning" not in err


async def test_reconcile_names_an_undeclared_tool_in_one_line(tmp_path: Path) -> None:
    journal, delegation, env = await killed_mid_payment(tmp_path)
    code, out, err = await reconcile(env, "--journal", journal, "--json")
    assert code == 1, err  # a person must settle it: nothing says what happened
    (report,) = [r for r in json.loads(out) if r["delegation"] == delegation]
    (action,) = report["children"][0]["actions"]
    assert action["state"] == "UNKNOWN"
    assert "TETHER_TOOLS" in action["evidence"]["reason"]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning:"), err
    assert "'refund'" in lines[0] and "TETHER_TOOLS=module:attribute" in lines[0]


async def test_the_next_supervisor_probes_an_adapter_agent_on_postgresql(pg_url: str) -> None:
    """The conformance kit's scenario (a terminate leaves the refund in doubt, it lands, the
    supervisor closes, the next one is told by TETHER_TOOLS alone) on the other backend."""
    await run_scenario("nested_probed_by_the_next_supervisor", PydanticAi(), pg_url)


async def not_yet(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
    return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED)  # before the deadline: in doubt


@tether.tool(effect=tether.Effect.EXTERNAL, probe=not_yet)
async def unprobed(order_id: str, *, idempotency_key: str) -> str:
    await asyncio.Event().wait()  # its reply never comes
    return "never"


async def test_an_undeclared_tool_is_one_log_line_and_unknown(
        journal_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    async def two_calls(ctx: tether.Context) -> None:
        await asyncio.gather(ctx.call(unprobed, order_id="A"), ctx.call(unprobed, order_id="B"))

    monkeypatch.delenv("TETHER_TOOLS", raising=False)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        handle = await sup.delegate(two_calls, tools=[unprobed])
        async with asyncio.timeout(30):
            while len((await sup.report(handle.id)).actions) < 2:
                await sup.wake(0.01)
        first = await handle.terminate(reason="stop")
    assert [a.state for a in first.actions] == [tether.ActionState.IN_DOUBT] * 2, first
    caplog.set_level(logging.WARNING, logger="tether")
    caplog.clear()
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        report = await sup.report(handle.id)
        assert sup.undeclared_tools == {"unprobed"}
    assert [a.state for a in report.actions] == [tether.ActionState.UNKNOWN] * 2, report
    assert all("TETHER_TOOLS" in (a.evidence or {})["reason"] for a in report.actions)
    said = [r.getMessage() for r in caplog.records if "declared" in r.getMessage()]
    assert len(said) == 1 and "'unprobed'" in said[0] and "TETHER_TOOLS" in said[0], said


@pytest.mark.parametrize(("spec", "says"), [
    ("tests.adapter_tools", "expected module:attribute"),
    ("tests.no_such_module:tools", "cannot import tests.no_such_module"),
    ("tests.adapter_tools:nothing", "has no attribute nothing"),
    ("tests.adapter_tools:pay", "is not a tether tool or agent"),
    ("tests.test_declared_tools:CLASHING", "two tools are named 'refund' with different"),
])
def test_a_bad_declaration_is_refused_in_one_line(
        spec: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_TOOLS", spec)
    with pytest.raises(tether.errors.UserError) as caught:
        tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}")
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith("TETHER_TOOLS")
    tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", tools=[])  # given: not read


async def _lookup_a(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
    return tether.ProbeResult(tether.ProbeOutcome.UNKNOWN)


async def _lookup_b(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
    return tether.ProbeResult(tether.ProbeOutcome.UNKNOWN)


async def _refund(order_id: str, *, idempotency_key: str) -> str:
    return "r"


async def _agent(ctx: tether.Context) -> None:
    pass


CLASHING = [tether.tool(name="refund", probe=_lookup_a)(_refund),
            tether.agent(tools=[tether.tool(name="refund", probe=_lookup_b)(_refund)])(_agent)]


def test_reconcile_refuses_a_bad_tether_tools_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tether._cli.app import app

    journal = f"sqlite:///{tmp_path / 'j.db'}"
    result = CliRunner().invoke(app, ["reconcile", "--journal", journal],
                                env={"TETHER_TOOLS": "tests.adapter_tools:pay"})
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "TETHER_TOOLS" in lines[0] and "not a tether tool or agent" in lines[0]


# Another deployment's "refund": same name, another provider, whose probe finds nothing.
async def _elsewhere(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
    return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED)


OTHER_REFUND = [tether.tool(name="refund", probe=_elsewhere)(_refund)]


async def test_a_childs_call_is_probed_with_its_own_tool_not_a_declared_namesake(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """$TETHER_TOOLS names a "refund" of another provider; this process delegates an agent
    whose own "refund" applied. Its call is probed with the tool it used: COMPLETED, never
    the namesake's NOT_APPLIED (a refund paid twice on the next re-plan)."""
    started = asyncio.Event()

    async def landed(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        return tether.ProbeResult(tether.ProbeOutcome.COMPLETED)

    @tether.tool(name="refund", probe=landed, dispatch_deadline=0.2)
    async def refund(order_id: str, *, idempotency_key: str) -> str:
        started.set()
        await asyncio.Event().wait()  # applied; its reply never comes
        return "never"

    async def pays(ctx: tether.Context) -> None:
        await ctx.call(refund, order_id="A")

    monkeypatch.setenv("TETHER_TOOLS", "tests.test_declared_tools:OTHER_REFUND")
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        handle = await sup.delegate(pays, tools=[refund])
        async with asyncio.timeout(30):
            await started.wait()
        await asyncio.sleep(0.3)  # past its deadline: the probe's answer is final
        report = await handle.terminate(reason="stop")
    (action,) = report.actions
    assert action.state is tether.ActionState.COMPLETED, report


UNDONE: list[str] = []


async def _undo_elsewhere(order_id: str, *, idempotency_key: str) -> str:
    UNDONE.append(f"elsewhere {order_id}")
    return "undone elsewhere"


OTHER_UNDO = [tether.tool(name="refund", compensate=_undo_elsewhere)(_refund)]


async def test_a_childs_call_is_compensated_with_its_own_tool_not_a_declared_namesake(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def undo(order_id: str, *, idempotency_key: str) -> str:
        UNDONE.append(f"own {order_id}")
        return "undone"

    @tether.tool(name="refund", compensate=undo)
    async def refund(order_id: str, *, idempotency_key: str) -> str:
        return "refunded"

    async def pays(ctx: tether.Context) -> None:
        await ctx.call(refund, order_id="A")

    UNDONE.clear()
    monkeypatch.setenv("TETHER_TOOLS", "tests.test_declared_tools:OTHER_UNDO")
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        handle = await sup.delegate(pays, tools=[refund])
        await handle.wait()
        await sup.compensate(await handle.report())
    assert UNDONE == ["own A"]


@pytest.mark.parametrize(("body", "says"), [
    ("import sys\nsys.exit(0)\n", "cannot import declared_exits: SystemExit: 0"),
    ("class R:\n    def __repr__(self):\n        raise ValueError('no')\nR_ = R()\n",
     "a R is not a tether tool or agent"),
])
def test_a_declaration_that_exits_or_cannot_be_shown_is_one_error(
        body: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that calls sys.exit() as it is imported does not end the process that asked
    (silently, with status 0); an object whose repr raises is still one line."""
    (tmp_path / "declared_exits.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "declared_exits", raising=False)
    monkeypatch.setenv("TETHER_TOOLS", "declared_exits:R_")
    with pytest.raises(tether.errors.UserError) as caught:
        tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}")
    assert says in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert not (tmp_path / "j.db").exists()
