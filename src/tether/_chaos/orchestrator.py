"""One chaos trial's orchestrator: a real process, killed with SIGKILL at the plan's point.

Run as ``python -m tether._chaos.orchestrator DIR PLAN_JSON JOURNAL_URL``. Its children refund
orders at a simulated provider that writes the shared ledger; the harness reconciles after.
For the cross-process faults it starts helper processes of its own (``tether worker``, the
``tether recall`` CLI, a second supervisor) and pauses its workers with SIGSTOP; every signal,
control and helper exit is noted in the trial's trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import tether
from tether._chaos import faults, stacks
from tether._chaos.plan import GAVE_UP, Plan
from tether._chaos.world import Trial, build, policy

WORKER_AGENTS = "tether._chaos.agents:AGENTS"
START_TRIES = 15  # a worker that cannot start is tried this many times, 0.2 s apart


class GaveUp(Exception):
    """No worker could start: the orchestrator's waits for their results would never end."""


class Helpers:
    """The helper processes this orchestrator started, each ended by its own pid."""

    def __init__(self, trial: Trial, url: str) -> None:
        self.trial = trial
        self.url = url
        self.running: dict[int, tuple[str, asyncio.subprocess.Process]] = {}
        self.paused: set[int] = set()
        self.stopping: set[int] = set()
        self._n = 0
        self.gave_up = ""  # why the orchestrator stopped waiting for its workers

    async def spawn(self, role: str, *argv: str,
                    ready: str | None = None) -> asyncio.subprocess.Process:
        self._n += 1
        path = self.trial.directory / f"{role}-{self._n}.log"
        log = path.open("wb")
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *argv, env=self.trial.env(), stdout=asyncio.subprocess.PIPE,
                stderr=log)
        finally:
            log.close()
        self.running[proc.pid] = (role, proc)
        self.trial.note("spawn", role, pid=proc.pid)
        if ready is not None:
            assert proc.stdout is not None
            async with asyncio.timeout(20):
                line = (await proc.stdout.readline()).decode()
            if not line.startswith(ready):
                if not line:  # it exited: its reason is the last line it wrote to stderr
                    async with asyncio.timeout(20):
                        await proc.wait()
                    said = path.read_text(errors="replace").strip().splitlines()
                    line = said[-1] if said else f"exit code {proc.returncode}"
                raise RuntimeError(f"{role} did not start: {line!r}")
        return proc

    async def worker(self) -> asyncio.subprocess.Process:
        return await self.spawn("worker", "-m", "tether", "worker", "--journal", self.url,
                                "--agents", WORKER_AGENTS, "--lease", f"{self.trial.plan.lease}",
                                "--stop-timeout", "1", ready="worker ")

    def signal(self, proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
        role = self.running.get(proc.pid, ("helper", proc))[0]
        if proc.returncode is not None:
            return
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            return  # it exited and was reaped before asyncio set its returncode
        if sig is signal.SIGSTOP:
            self.paused.add(proc.pid)
        elif sig is signal.SIGCONT:
            self.paused.discard(proc.pid)
        self.trial.note("signal", role, sig=sig.name, pid=proc.pid)

    def pause(self, proc: asyncio.subprocess.Process, seconds: float) -> threading.Timer:
        """SIGSTOP ``proc``, and SIGCONT it ``seconds`` later from a thread. The SIGCONT is
        scheduled before the stop is sent and noted: the process may be stopped inside a write
        to the ledger, and noting the stop then waits for that lock, which only the SIGCONT
        releases (the event loop waits too)."""
        timer = threading.Timer(seconds, self.resume, (proc.pid,))
        timer.start()
        self.signal(proc, signal.SIGSTOP)
        return timer

    def resume(self, pid: int) -> None:
        """SIGCONT, from any thread."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            self.paused.discard(pid)
            self.trial.note("signal", self.running.get(pid, ("helper", None))[0],
                            sig="SIGCONT", pid=pid)

    async def wait(self, proc: asyncio.subprocess.Process, within: float) -> tuple[
            int | None, str]:
        """Its exit code and output, or None (noted as hung, then killed) after ``within``
        seconds."""
        role = self.running.get(proc.pid, ("helper", proc))[0]
        try:
            async with asyncio.timeout(within):
                out, _ = await proc.communicate()
        except TimeoutError:
            self.trial.note("helper_hung", role, pid=proc.pid, after=within)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            await proc.wait()
            self.running.pop(proc.pid, None)
            return None, ""
        self.running.pop(proc.pid, None)
        self.trial.note("exit", role, pid=proc.pid, code=proc.returncode)
        return proc.returncode, out.decode(errors="replace")

    async def stop(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM (a worker gives up its lease), then wait a while for it."""
        if proc.returncode is None and proc.pid in self.running:
            self.stopping.add(proc.pid)
            if proc.pid in self.paused:
                self.signal(proc, signal.SIGCONT)
            self.signal(proc, signal.SIGTERM)
        if proc.pid in self.running:
            await self.wait(proc, 6.0)

    async def finish(self) -> None:
        for _, proc in list(self.running.values()):
            await self.stop(proc)


class Workers:
    """The trial's `tether worker`: replaced when it exits on its own (a paused one finds its
    lease gone and exits 3), as an operator would, until the orchestrator is done."""

    def __init__(self, helpers: Helpers) -> None:
        self.helpers = helpers
        self.current: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self.main: asyncio.Task[Any] | None = None  # cancelled when the workers give up

    async def start(self) -> asyncio.subprocess.Process:
        self.main = asyncio.current_task()
        self.current = await self.helpers.worker()
        self._watch = asyncio.create_task(self._keep())
        return self.current

    async def _keep(self) -> None:
        while True:
            proc = self.current
            assert proc is not None
            code = await proc.wait()
            if proc.pid in self.helpers.stopping:
                return
            self.helpers.running.pop(proc.pid, None)
            self.helpers.trial.note("exit", "worker", pid=proc.pid, code=code)
            self.current = await self._restart()
            if self.current is None:
                return

    async def _restart(self) -> asyncio.subprocess.Process | None:
        """As a service manager would: a worker that cannot start (its journal's disk is full)
        is tried again a moment later; after START_TRIES failures the orchestrator gives up
        (its waits for the workers' results would never end) and exits with the reason."""
        last = ""
        for _ in range(START_TRIES):
            try:
                return await self.helpers.worker()
            except RuntimeError as exc:
                last = str(exc)[:200]
                self.helpers.trial.note("worker_start_failed", "worker", error=last)
                await asyncio.sleep(0.2)
        self.helpers.gave_up = (f"no worker could start, {START_TRIES} tries in a row; the "
                                f"last: {last}")
        if self.main is not None:
            self.main.cancel()  # which raises GaveUp, with the reason
        return None

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.current is not None:
            await self.helpers.stop(self.current)


async def run(directory: Path, plan: Plan, url: str) -> None:
    trial = Trial(directory, plan, "orchestrator")
    faults.install(plan.bug)
    helpers = Helpers(trial, url)
    try:
        await orchestrate(trial, url, helpers)
    except asyncio.CancelledError:
        if helpers.gave_up:
            raise GaveUp(helpers.gave_up) from None
        raise
    finally:
        await helpers.finish()


async def orchestrate(trial: Trial, url: str, helpers: Helpers) -> None:
    plan = trial.plan
    refund, _, child = build(trial)
    redispatch = tether.RedispatchPolicy(retry_safe=frozenset({"lookup"}),
                                         settle_delay=plan.settle)
    workers = Workers(helpers)
    left_early = False
    async with tether.Supervisor(url, policy=policy(plan), redispatch=redispatch,
                                 tools=[refund]) as sup:
        if plan.fault == "kill_random":
            _kill_after(plan.kill_after)
        if plan.fault == "pg_lost":  # the MCP proxy's mode: posts and answers skip the disk
            sup.journal.relaxed_posts = True
            trial.answered = functools.partial(sup.journal.flush, durable=False)
        sent = asyncio.Event()
        if plan.fault == "late_apply":  # its control counts from the first request sent
            trial.on_first_send = sent.set
            if plan.variant == "kill":
                trial.on_first_send = functools.partial(_kill_after, plan.kill_after)
        if plan.fault == "kill_in_grace":
            loop = asyncio.get_running_loop()

            def kill_in_window(event: str, _: str) -> None:
                if event == "drain":
                    loop.call_later(plan.grace / 2, os.kill, os.getpid(), signal.SIGKILL)

            sup.listen(kill_in_window)
        ended: dict[str, asyncio.Event] = {}

        def on_event(event: str, delegation_id: str) -> None:
            if event == "ended":
                ended.setdefault(delegation_id, asyncio.Event()).set()

        sup.listen(on_event)
        if plan.remote:
            await workers.start()
        handles = []
        for i in range(plan.children):
            cut_at = trial.rng.randint(0, plan.refunds)
            if plan.fault == "cancel_in_delay" or (plan.fault == "exit_in_flight" and i == 0):
                cut_at = -1  # cut before any tool ran: re-dispatched after the settle delay
            handles.append(await sup.delegate(child, f"o{plan.seed}-{i}", plan.refunds, cut_at,
                                              task_id=f"t{plan.seed}-{i}", remote=plan.remote))
        trial.note("delegated", "", delegations=[h.id for h in handles])
        if plan.fault == "exit_in_flight":
            await asyncio.sleep(plan.control_after)
            trial.note("leaving", "", running=[h.id for h in handles])
            left_early = True
        else:
            await control(trial, helpers, workers, handles, ended, sent)
            await sup.journal.flush()
            trial.note("closing", "")
    trial.note("left", "")
    if left_early and plan.remote:
        await wait_all_terminal(url, 10.0)
    await workers.stop()


def _kill_after(seconds: float) -> None:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


async def results(handles: list[tether.Handle]) -> None:
    for handle in handles:
        with contextlib.suppress(tether.TetherError):
            await handle.result()


async def control(trial: Trial, helpers: Helpers, workers: Workers,
                  handles: list[tether.Handle], ended: dict[str, asyncio.Event],
                  sent: asyncio.Event) -> None:
    plan = trial.plan
    first = handles[0]
    if plan.fault == "pause_worker":
        await asyncio.sleep(plan.pause_after)
        worker = workers.current
        assert worker is not None
        timer = helpers.pause(worker, plan.pause_for)
        await results(handles)
        await asyncio.to_thread(timer.join)
        return
    if plan.fault == "pause_orchestrator":  # the harness pauses this process
        if plan.variant == "remote":
            await asyncio.sleep(plan.control_after)
            trial.note("control_sent", first.task_id, how="recall", grace=plan.grace)
            with contextlib.suppress(tether.TetherError):
                await first.recall(grace=plan.grace, reason="chaos")
            trial.note("control_returned", first.task_id, how="recall")
        await results(handles)
        return
    if plan.fault == "cancel_in_delay":
        attempt = first.id
        async with asyncio.timeout(10):
            await ended.setdefault(attempt, asyncio.Event()).wait()
        await asyncio.sleep(plan.control_after)  # inside the settle delay
        if plan.variant == "cli_terminate":
            await cli(trial, helpers, first.task_id, "terminate", attempt, results(handles))
        else:
            how = "cancel" if plan.variant == "sup_cancel" else "terminate"
            proc = await helpers.spawn(
                "canceller", "-m", "tether._chaos.canceller", str(trial.directory),
                plan.to_json(), helpers.url, attempt, first.task_id, how)
            await asyncio.gather(results(handles), helpers.wait(proc, 15.0))
        return
    if plan.fault == "cli_recall":
        await asyncio.sleep(plan.control_after)
        await cli(trial, helpers, first.task_id, "recall", first.id, results(handles),
                  "--grace", f"{plan.grace}")
        return
    if plan.fault == "late_apply":
        if plan.variant == "kill":  # the timer armed at the first send ends this process
            await results(handles)
            return
        async with asyncio.timeout(10):  # every child sends a refund first
            await sent.wait()
        await asyncio.sleep(plan.control_after)
        if plan.variant == "terminate":
            await first.terminate("chaos")
        elif plan.variant == "recall":
            await first.recall(grace=plan.grace, reason="chaos")
        await results(handles)
        return
    await asyncio.sleep(plan.control_after)
    if plan.fault in ("recall", "slow_tool", "kill_in_grace"):
        await first.recall(grace=plan.grace, reason="chaos")
    elif plan.fault in ("terminate", "kill_in_reconcile", "probe_fail"):
        await first.terminate("chaos")
    elif plan.fault == "race":
        async def racer() -> None:
            try:
                await first.recall(grace=plan.grace, reason="race")
                fresh = await first.redelegate()
            except tether.errors.ControlRefused:
                return
            with contextlib.suppress(tether.TetherError):
                await fresh.result()

        await asyncio.gather(racer(), racer())
    await results(handles)


async def cli(trial: Trial, helpers: Helpers, task_id: str, command: str, delegation_id: str,
              meanwhile: Awaitable[None], *extra: str) -> None:
    """``tether recall|terminate ID`` in a process of its own, while ``meanwhile`` runs."""
    trial.note("control_sent", task_id, how=f"cli {command}", delegation=delegation_id)
    proc = await helpers.spawn(f"cli-{command}", "-m", "tether", command, delegation_id,
                               "--journal", helpers.url, "--json", *extra)

    async def answer() -> None:
        code, out = await helpers.wait(proc, 20.0)
        if code is None:
            return
        detail: dict[str, object] = {"code": code}
        with contextlib.suppress(ValueError):
            data = json.loads(out)
            detail["outcome"] = (data.get("report") or {}).get("outcome")
            detail["waiting"] = "waiting" in data
        trial.note("control_returned", task_id, how=f"cli {command}", **detail)

    await asyncio.gather(meanwhile, answer())


async def wait_all_terminal(url: str, within: float) -> None:
    """After leaving the supervisor: the workers still run what was queued; wait for it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    async with tether.Journal(url, create=False) as j:
        while loop.time() < deadline:
            rows = await j.delegations()
            if all(r.state.terminal for r in rows):
                return
            await asyncio.sleep(0.05)


def main(directory: Path, plan: Plan, url: str) -> int:
    """Exit 0 once the plan ran, GAVE_UP when its journal refused to go on (a JournalError:
    the disk it lives on is full or read-only) or no worker could start. The harness accepts a
    give-up only where the trial's fault explains it; any other exception is a crash."""
    try:
        asyncio.run(run(directory, plan, url))
    except (tether.errors.JournalError, GaveUp) as exc:
        print(f"gave up: {type(exc).__name__}: {exc}", flush=True)
        return GAVE_UP
    return 0


if __name__ == "__main__":
    # A hung trial is asked for every thread's and task's stack (SIGUSR1) before it is
    # killed: the harness keeps them in the trial's record, so that a hang says where it waited.
    stacks.install()
    sys.exit(main(Path(sys.argv[1]), Plan.from_json(sys.argv[2]), sys.argv[3]))
