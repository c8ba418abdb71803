"""tether on Temporal under the faults Temporal users meet, on both journals: a worker process
killed in the middle of an activity (before its provider applied the refund, or after it
applied and before the reply), and the Temporal server itself restarted (killed, then started
again on its own history) between a workflow's activities and during one. Temporal retries the
activity on another worker; tether there finds the dead worker's call in its journal,
reconciles it with the provider's own answer and either replays the result or makes the call,
so the refund happens exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError

import tether
import tether.temporal
from tests.cli_helpers import tether_here
from tests.conftest import ONE_CLOCK, settled, until
from tests.temporal_flows import Refund, TwoRefunds
from tests.temporal_helpers import serving, start_server, stop_server, temporal_binary
from tests.temporal_killable import refund_tool, undeclared_worker, worker
from tests.temporal_world import actions
from tests.test_trust import raw
from tether._chaos.pgserver import free_port
from tether._core.documents import ControlIntent, decode
from tether._core.signing import SigningKey
from tether._integrations.temporal_runs import RunRefused, open_run, run_stopped
from tether.testing import PaymentService

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def world(tmp_path: Path) -> Path:
    (tmp_path / "world").mkdir()
    return tmp_path / "world"


@contextlib.asynccontextmanager
async def killable(address: str, queue: str, journal: str, world: Path, stop: str,
                   *flags: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """The worker process of ``tests.temporal_killable``, once its refund reached ``stop``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with (world / "worker.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.temporal_killable", address, queue, journal,
            str(world), "--stop", stop, *flags, env=env, cwd=ROOT, stderr=log)
        try:
            await until(lambda: (world / "stopped").exists() or proc.returncode is not None,
                        "the killable worker's refund under way")
            assert proc.returncode is None, (world / "worker.log").read_text()[-2000:]
            yield proc
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


@pytest.mark.parametrize("stop", ["before", "after"])
async def test_a_worker_killed_mid_activity_leaves_one_refund(
        client: Client, temporal_address: str, journal_url: str, world: Path,
        stop: str) -> None:
    queue = f"q-{uuid.uuid4().hex[:12]}"
    workflow_id = f"wf-kill-{stop}"
    handle = await client.start_workflow(Refund.run, args=["refund", "K-1", 1250],
                                         id=workflow_id, task_queue=queue)
    async with killable(temporal_address, queue, journal_url, world, stop) as proc:
        proc.kill()  # SIGKILL: nothing of it runs on
    # Temporal retries the activity once its heartbeat times out, here.
    tool = refund_tool(world)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, tools=[tool]) as sup, \
            worker(client, queue, sup, tool):
        ref = await handle.result()
        done = await actions(sup, workflow_id)
    bank = PaymentService(path=str(world / "ledger.db"))
    (entry,) = bank.entries("K-1")  # one refund, whoever applied it
    assert ref == entry.ref
    key = f"temporal:{workflow_id}:refund:1"
    calls = (world / "calls").read_text().split()
    # After: the refund was applied; the retry finds it in the provider's ledger (the probe)
    # and replays it, without calling again. Before: the probe says nothing was applied, once
    # past the call's dispatch deadline; the retry makes the call, under the same key.
    assert calls == ([key] if stop == "after" else [key, key])
    assert entry.key == key
    # One action per call made, each on its own epoch's delegation: the dead worker's
    # reconciled, the new epoch's completed (or replayed).
    states = [(a.idempotency_key, a.state) for a in done]
    A = tether.ActionState
    if stop == "after":
        assert (key, A.COMPLETED) in states
        assert all(state is A.COMPLETED for _, state in states)
    else:
        assert states[-1] == (key, A.COMPLETED)
        assert all(state in (A.NOT_APPLIED, A.COMPLETED) for _, state in states)


@pytest.mark.parametrize("probed", [True, False])
async def test_a_plain_activity_killed_after_it_applied_is_settled_by_its_probe(
        client: Client, temporal_address: str, journal_url: str, world: Path,
        probed: bool) -> None:
    """The refund as a plain Temporal activity (not a tether tool: a framework's, say), its
    worker killed once the refund applied. With its probe named in the plugin's ``probes``,
    the next worker's recovery finds it in the provider's ledger and the retry replays it:
    one refund, one call, the workflow done. Without one, the call stays UNKNOWN, the retry
    waits for it and the workflow fails (a person decides): still one refund, never a second."""
    queue = f"q-{uuid.uuid4().hex[:12]}"
    workflow_id = f"wf-plain-{uuid.uuid4().hex[:8]}"
    # Retried once: the attempt after the killed worker's, then the end.
    handle = await client.start_workflow(Refund.run, args=["refund", "P-1", 1250, 2],
                                         id=workflow_id, task_queue=queue)
    async with killable(temporal_address, queue, journal_url, world, "after",
                        "--undeclared") as proc:
        proc.kill()
    tool = refund_tool(world)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, tools=[]) as sup, \
            undeclared_worker(client, queue, sup, tool, probed=probed):
        if probed:
            ref = await handle.result()
        else:  # the retry waits for the call in doubt (until its deadline) and times out
            with pytest.raises(WorkflowFailureError):
                await handle.result()
        done = await actions(sup, workflow_id)
    bank = PaymentService(path=str(world / "ledger.db"))
    (entry,) = bank.entries("P-1")  # one refund, whoever applied it
    key = f"temporal:{workflow_id}:refund:1"
    assert (world / "calls").read_text().split() == [key] and entry.key == key
    A = tether.ActionState
    if probed:
        assert ref == entry.ref
        assert [a.state for a in done] and all(a.state is A.COMPLETED for a in done)
    else:
        assert [a.state for a in done] == [A.UNKNOWN]


async def test_the_temporal_server_restarted_mid_workflow_leaves_one_refund_each(
        journal_url: str, world: Path, tmp_path: Path) -> None:
    """The server is SIGKILLed (no shutdown of its own) while the worker waits for the
    workflow's signal, and again while a refund is held after it applied, then restarted on
    its history: the worker reconnects, the held activity's reply reaches Temporal (or its
    retry replays it by key), and the workflow ends with each refund applied once."""
    binary = temporal_binary()
    assert binary is not None, "scripts/test installs the Temporal CLI"
    address, db, log = f"127.0.0.1:{free_port()}", tmp_path / "temporal.db", tmp_path / "t.log"

    def start() -> subprocess.Popen[bytes]:
        server = start_server(binary, address, log, db)
        if not serving(server, binary, address):
            stop_server(server)
            pytest.fail(f"the Temporal dev server did not start: {log.read_text()[-2000:]}")
        return server

    def kill(server: subprocess.Popen[bytes]) -> None:
        server.kill()
        server.wait()

    server = start()
    held = asyncio.Event()
    held.set()
    tool = refund_tool(world, hold=held)
    queue = f"q-{uuid.uuid4().hex[:12]}"
    try:
        client = await Client.connect(address)
        async with tether.Supervisor(journal_url, policy=ONE_CLOCK, tools=[tool]) as sup, \
                worker(client, queue, sup, tool):
            handle = await client.start_workflow(TwoRefunds.run, args=["R-1", "R-2"],
                                                 id="wf-restart", task_queue=queue)
            bank = PaymentService(path=str(world / "ledger.db"))
            await recorded(sup, "wf-restart", 1)  # its reply to Temporal may be lost
            held.clear()  # the second refund waits, applied, for the second restart
            kill(server)
            server = start()
            await handle.signal(TwoRefunds.proceed)
            await until(lambda: len(bank.entries("R-2")) == 1, "the second refund applied")
            kill(server)
            server = start()
            held.set()
            refs = await handle.result()
            done = await actions(sup, "wf-restart")
    finally:
        stop_server(server)
    assert [len(bank.entries(order)) for order in ("R-1", "R-2")] == [1, 1]
    assert refs == [bank.entries("R-1")[0].ref, bank.entries("R-2")[0].ref]
    keys = ["temporal:wf-restart:refund:1", "temporal:wf-restart:refund:2"]
    # A retry after the restart (the reply to the first attempt lost with the server) finds
    # the call completed under its key and replays it: each key reached the provider once.
    assert (world / "calls").read_text().split() == keys
    assert {(a.idempotency_key, a.state) for a in done} == {
        (k, tether.ActionState.COMPLETED) for k in keys}


async def recorded(sup: tether.Supervisor, workflow_id: str, count: int) -> None:
    """Until ``count`` of the workflow's calls are completed in the journal (polled)."""
    A = tether.ActionState
    give_up = asyncio.get_running_loop().time() + 60
    while sum(a.state is A.COMPLETED for a in await actions(sup, workflow_id)) < count:
        assert asyncio.get_running_loop().time() < give_up, f"never: {count} calls completed"
        await asyncio.sleep(0.05)


async def test_a_recalled_run_whose_worker_then_dies_stays_out(
        client: Client, temporal_address: str, journal_url: str, world: Path) -> None:
    """Someone recalls the run (in the journal only: Temporal is not told, so it retries the
    activity), and its worker dies before its drain ends. The recovery that settles the
    delegation is tether's own; the recall before it was someone's, and keeps the run out:
    the retry on another worker is refused for good, and nothing is refunded."""
    queue = f"q-{uuid.uuid4().hex[:12]}"
    handle = await client.start_workflow(Refund.run, args=["refund", "K-2", 1250],
                                         id="wf-kill-recalled", task_queue=queue)
    tool = refund_tool(world)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, tools=[tool]) as sup:
        async with killable(temporal_address, queue, journal_url, world, "before") as proc:
            (row,) = await sup.journal.delegations()
            recall = asyncio.ensure_future(sup.handle_for(row.id).recall(30.0, "operator"))
            await wait_accepted(sup, row.id)  # before the kill
            proc.kill()  # SIGKILL: nothing of it runs on
        await recall  # in doubt until the call's dispatch deadline has passed
        async with worker(client, queue, sup, tool):
            with pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
        report = await settled(sup, row.id)
    assert "recalled or terminated" in str(failed.value.cause.__cause__)
    assert PaymentService(path=str(world / "ledger.db")).entries("K-2") == []
    assert [a.state for a in report.actions] == [tether.ActionState.NOT_APPLIED]


async def wait_accepted(sup: tether.Supervisor, delegation_id: str) -> None:
    give_up = asyncio.get_running_loop().time() + 30
    while (await sup.journal.get(delegation_id)).control_seq == 0:
        assert asyncio.get_running_loop().time() < give_up, "never: the recall accepted"
        await asyncio.sleep(0.02)


async def test_a_recall_after_a_dead_workers_recovery_keeps_the_run_out(
        client: Client, temporal_address: str, journal_url: str, world: Path) -> None:
    """The worker died and a recovery settled its delegation (which lets the run go on); then
    the orchestrator recalls the run. The ended delegation has nothing left to recall, so the
    recall opens the run's next epoch itself and fences it: the run stays out of the journal
    whatever Temporal does, and nothing is refunded."""
    queue = f"q-{uuid.uuid4().hex[:12]}"
    workflow_id = f"wf-recall-recovered-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(Refund.run, args=["refund", "K-3", 1250],
                                         id=workflow_id, task_queue=queue)
    async with killable(temporal_address, queue, journal_url, world, "before") as proc:
        proc.kill()
    tool = refund_tool(world)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, tools=[tool]) as sup:
        await sup.recover()
        (dead,) = await sup.journal.delegations()
        assert dead.fenced and dead.control_seq == 1  # the recovery's TERMINATE
        report = await tether.temporal.recall(handle, supervisor=sup, grace=5.0,
                                              reason="operator")
        assert report.delegation_id != dead.id and report.actions == ()
        head = await sup.journal.get(report.delegation_id)
        assert (head.epoch, head.control_seq) == (1, 1)
        with pytest.raises(RunRefused, match="recalled or terminated"):
            await open_run(sup, workflow_id, (await handle.describe()).run_id,
                           tether.Agent("temporal:Refund", held))
        async with worker(client, queue, sup, tool):
            with contextlib.suppress(WorkflowFailureError):
                await handle.result()  # cancelled in Temporal, after the journal's fence
        report = await settled(sup, dead.id)
    assert PaymentService(path=str(world / "ledger.db")).entries("K-3") == []
    assert [a.state for a in report.actions] == [tether.ActionState.NOT_APPLIED]


async def held(ctx: tether.Context, workflow_id: str, run_id: str) -> None:
    await asyncio.Event().wait()


async def test_only_trusted_recoveries_for_the_same_row_let_a_run_go_on(
        journal_url: str) -> None:
    """What ``run_stopped`` believes: the recovery's own intent, as signed. Re-signed by a key
    the deployment does not trust, or gone from its row, it counts as someone's stop (fail
    closed), whatever the chain check after it would say."""
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        h = await sup.delegate(tether.Agent("temporal:Flow", held), "wf-unit", "run-1",
                               task_id=tether.temporal.task_of("wf-unit"))
        row = await sup.journal.get(h.id)
        await sup.recover_delegation(row, "owner is gone")
        head = await sup.journal.get(h.id)
        assert head.control_seq == 1 and not await run_stopped(sup, head)
        code, shown, _ = await tether_here("show", h.id, "--journal", journal_url)
        assert code == 0 and "recovery (signed)" in " ".join(shown.split()), shown
        (control,) = await sup.journal.controls(h.id)
        intent = decode(control.signed.body)
        assert isinstance(intent, ControlIntent) and intent.recovery
        other = SigningKey.generate().sign(intent)
        await raw(sup.journal, "UPDATE controls SET key_id = ?, signature = ? WHERE "
                  "delegation_id = ?", other.key_id, other.signature, h.id)
        assert await run_stopped(sup, head)
        await raw(sup.journal, "DELETE FROM controls WHERE delegation_id = ?", h.id)
        assert await run_stopped(sup, head)


async def test_a_recovery_signed_by_a_key_the_registry_granted_lets_a_run_go_on(
        journal_url: str, tmp_path: Path) -> None:
    """A worker whose key the journal's root granted (``tether keys trust``), not one the
    deployment pins, recovers a dead worker's run: its signed recovery is judged against the
    registry, as every intent is, so the run goes on at a new epoch; and the orchestrator,
    which pins only the root, reads it the same."""
    root = tether.KeyRing.init(tmp_path / "root")
    granted = tether.KeyRing.init(tmp_path / "worker")
    granted.pin(root.signer.key_id, root.signer.public_b64())
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, keys=root) as orchestrator:
        h = await orchestrator.delegate(tether.Agent("temporal:Flow", held), "wf-granted",
                                        "run-1", task_id=tether.temporal.task_of("wf-granted"))
        await orchestrator.journal.change_trust(
            root.signer, root.trusted, "trust", granted.signer.key_id,
            granted.signer.public_b64(), "worker", orchestrator.clock.wall())
        async with tether.Supervisor(journal_url, policy=ONE_CLOCK, keys=granted,
                                     recover=False) as recovering:
            await recovering.recover_delegation(await recovering.journal.get(h.id),
                                                "owner is gone")
            head = await recovering.journal.get(h.id)
            (control,) = await recovering.journal.controls(h.id)
            assert control.signed.key_id == granted.signer.key_id  # not the root's
            assert not await run_stopped(recovering, head)
        assert not await run_stopped(orchestrator, head)


async def test_tether_recall_of_a_dead_workers_ended_epoch_stops_the_run_in_temporal(
        client: Client, temporal_address: str, journal_url: str, world: Path) -> None:
    """From a shell, the delegation of a worker that died, already settled by a recovery:
    the journal has nothing left to recall there, and says that the run would go on at a new
    epoch; with --temporal the run's next epoch is opened and fenced in the journal (an
    activity afterwards is refused, whatever Temporal does with the cancel), then the
    workflow is cancelled in Temporal; the report holds the dead worker's epoch too."""
    from tests.temporal_world import cli

    queue = f"q-{uuid.uuid4().hex[:12]}"
    workflow_id = f"wf-shell-recovered-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(Refund.run, args=["refund", "K-4", 1250],
                                         id=workflow_id, task_queue=queue)
    async with killable(temporal_address, queue, journal_url, world, "before") as proc:
        proc.kill()
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        await sup.recover()
        (dead,) = await sup.journal.delegations()
        await settled(sup, dead.id)
    # As an operator types it (a process of its own: no test's log handlers in it).
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "recall", dead.id, "--journal", journal_url, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(ROOT)))},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out_bytes, err_bytes = await done.communicate()
    code, out, err = done.returncode, out_bytes.decode(), err_bytes.decode()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "nothing to recall in the journal" in err and "goes on at a new epoch" in err, err
    code, out, err = await asyncio.to_thread(
        cli, "recall", dead.id, "--journal", journal_url, "--temporal", temporal_address,
        "--json")
    # Exit 1: the report holds the run's earlier epoch, whose call the recovery (where no
    # tool was declared) left UNKNOWN for a person.
    assert code == 1, err
    answer = json.loads(out)
    run_id = (await handle.describe()).run_id
    assert answer["temporal"] == f"Temporal: workflow {workflow_id} run {run_id} cancelled."
    assert answer["report"]["epoch"] == 1 and answer["report"]["actions"] == []
    (earlier,) = answer["report"]["children"]
    assert (earlier["epoch"], earlier["outcome"]) == (0, "NEEDS_ATTENTION")
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        with pytest.raises(RunRefused, match="recalled or terminated"):
            await open_run(sup, workflow_id, run_id, tether.Agent("temporal:Refund", held))
