"""The ``tether`` command line."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

import typer
from typer._click.core import ParameterSource

from tether._cli.common import (
    ByOpt,
    JournalOpt,
    JsonOpt,
    KeysOpt,
    LogFormatOpt,
    LogLevelOpt,
    emit_json,
    out,
    run,
)
from tether._cli.controls import (
    AgentSelectOpt,
    SinceOpt,
    StateOpt,
    control_many,
    needs_person,
    selection,
)
from tether._cli.errors import Group, cli_errors, err
from tether._cli.safe import plain, safe
from tether._core.errors import AlreadyFinished, UserError
from tether._core.model import ControlKind, Policy, check_grace
from tether._journal.journal import DEFAULT_URL, Journal
from tether._runtime.declared import HOW, deployment_tools, load_tools
from tether._runtime.keys import KeyRing
from tether._runtime.logs import configure as configure_logs
from tether._runtime.resolve import operator_of
from tether._runtime.supervisor import Supervisor

app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False,
                  help="Recall, terminate and reconcile sub-agents with real side effects.")
keys_app = typer.Typer(no_args_is_help=True, help="Manage the signing key, the pinned root "
                       "and the journal's key registry.")
app.add_typer(keys_app, name="keys")
trace_app = typer.Typer(no_args_is_help=True, help="Timelines and failure forensics.")
app.add_typer(trace_app, name="trace")
def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        out.print(f"tether {version('tether')}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")]
          = False) -> None:
    """Recall, terminate and reconcile sub-agents with real side effects."""


def key_dir(journal: Journal, keys: Path | None) -> Path:
    return keys if keys is not None else journal.keys_dir


@app.command()
@cli_errors
def demo(journal: JournalOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """Show the three failures of naive recall, and tether preventing each."""
    from tether._cli.demo import run_demo

    ok = run(run_demo(journal, as_json, out))
    raise typer.Exit(0 if ok else 1)


@app.command()
@cli_errors
def show(delegation_id: str, journal: JournalOpt = DEFAULT_URL, as_json: JsonOpt = False,
         keys: KeysOpt = None) -> None:
    """Show a delegation's tree, actions, control intents (verified) and events."""
    from tether._cli.render import collect, render_show

    async def go() -> dict[str, Any]:
        async with Journal(journal, create=False) as j:
            ring = await asyncio.to_thread(_load_keys_or_none, key_dir(j, keys))
            return await collect(j, delegation_id, ring.trusted if ring else None)

    data = run(go())
    if as_json:
        emit_json(data)
    else:
        render_show(out, data)


def _load_keys_or_none(directory: Path) -> KeyRing | None:
    return KeyRing.load(directory) if (directory / "signing.json").exists() else None


def _control_cmd(kind: ControlKind, delegation_id: str, journal: str, grace: float | None,
                 reason: str, by: str | None, wait: bool, keys: Path | None,
                 as_json: bool, temporal: tuple[str | None, str] = (None, "default")) -> None:
    from tether._cli import temporal as on_temporal
    from tether._cli.render import render_report
    from tether._runtime.control import ControlRequest, send_control

    if kind is ControlKind.RECALL:
        check_grace(grace, Policy())
    address, namespace = temporal
    run_handle = None
    if address is not None:  # a name nobody can read is refused before Temporal is asked
        operator_of(by)
        run_handle = run(on_temporal.target(journal, keys, delegation_id, address, namespace,
                                                wait))
    request = ControlRequest(journal, keys, delegation_id, kind, grace, reason, by,
                             via="cli", wait=wait)
    try:
        answer = run(send_control(request))
    except AlreadyFinished as exc:
        ended = (f"nothing to {kind.value.lower()} in the journal: {exc} (a re-dispatch of its "
                 "task, if one was pending, is cancelled)")
        if run_handle is None:
            raise UserError(ended + run(on_temporal.run_goes_on(journal, delegation_id))) \
                from None
        # An ended epoch of a Temporal run: the run's current epoch is stopped, or its next
        # one opened and fenced (its run would go on there), then Temporal is told.
        report = run(on_temporal.fence_run(journal, keys, run_handle, kind, grace, reason))
        if report is None:  # someone's intent stopped the run already: Temporal, at least
            run(on_temporal.stop_run(run_handle, kind, reason))
        told = on_temporal.told(run_handle, kind)
        code = 0 if report is None or not needs_person(report) else 1
        if as_json:
            emit_json({"delegation": delegation_id, "journal": ended, "report": report,
                       "temporal": told})
        else:
            out.print(f"{safe(ended)}.", soft_wrap=True)
            if report is not None:
                done = "recalled" if kind is ControlKind.RECALL else "terminated"
                out.print(f"The run's delegation {safe(report['delegation'])} is {done} in "
                          "the journal instead:", soft_wrap=True)
                render_report(out, report)
            out.print(safe(told), soft_wrap=True)
        raise typer.Exit(code) from None
    # Exit 0 only when the delegation settled with nothing left for a person; 1 when it did
    # not settle (its owner is gone or slow) or needs attention: a script must not take an
    # accepted intent for a settled one.
    if run_handle is not None:  # the journal's report first, as tether.temporal.recall
        try:
            run(on_temporal.stop_children_apart(journal, keys, run_handle, answer, kind, grace,
                                                reason))
        finally:
            answer["temporal"] = run(on_temporal.stop_run(run_handle, kind, reason))
    elif note := on_temporal.not_told(answer):
        answer["temporal"] = note
    settled = "report" in answer and not needs_person(answer["report"])
    code = 0 if settled or not wait else 1
    if as_json:
        emit_json(answer)
        raise typer.Exit(code)
    out.print(f"{kind.value} accepted for {safe(answer['delegation'])} (sequence "
              f"{answer['seq']}, issued by {safe(answer['issuer'])}); the journal's fence is "
              "closed.", soft_wrap=True)
    if "report" in answer:
        render_report(out, answer["report"])
    elif "waiting" in answer:
        out.print(f"[yellow]{safe(answer['waiting'])}[/yellow]", soft_wrap=True)
    if "temporal" in answer:
        out.print(safe(answer["temporal"]) if run_handle is not None else
                  f"[yellow]{safe(answer['temporal'])}[/yellow]", soft_wrap=True)
    raise typer.Exit(code)


TemporalOpt = Annotated[str | None, typer.Option(
    "--temporal", envvar="TEMPORAL_ADDRESS", help="HOST:PORT of Temporal: a delegation that "
    "is a Temporal workflow run is then stopped there too, after the journal's report.")]
NamespaceOpt = Annotated[str, typer.Option(
    "--namespace", envvar="TEMPORAL_NAMESPACE", help="The Temporal namespace (--temporal).")]


@app.command()
@cli_errors
def recall(ctx: typer.Context, delegation_id: Annotated[str | None, typer.Argument()] = None,
           grace: Annotated[float, typer.Option("--grace", help="Seconds in-flight actions "
                                                "may still run.")] = 30.0,
           reason: Annotated[str, typer.Option("--reason")] = "",
           by: ByOpt = None, journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
           wait: Annotated[bool, typer.Option("--wait/--no-wait")] = True,
           agent: AgentSelectOpt = None, state: StateOpt = None, since: SinceOpt = None,
           temporal: TemporalOpt = None, namespace: NamespaceOpt = "default",
           as_json: JsonOpt = False) -> None:
    """Recall a delegation, or every live one that --agent, --state and --since select:
    signed intent, fence closed at once, grace for in-flight actions."""
    _control_any(ctx, ControlKind.RECALL, delegation_id, (agent, state, since), journal,
                 grace, reason, by, wait, keys, as_json, (temporal, namespace))


@app.command()
@cli_errors
def terminate(ctx: typer.Context,
              delegation_id: Annotated[str | None, typer.Argument()] = None,
              reason: Annotated[str, typer.Option("--reason")] = "",
              by: ByOpt = None, journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
              wait: Annotated[bool, typer.Option("--wait/--no-wait")] = True,
              agent: AgentSelectOpt = None, state: StateOpt = None, since: SinceOpt = None,
              temporal: TemporalOpt = None, namespace: NamespaceOpt = "default",
              as_json: JsonOpt = False) -> None:
    """Terminate a delegation now, or every live one that --agent, --state and --since
    select; their in-flight actions are probed."""
    _control_any(ctx, ControlKind.TERMINATE, delegation_id, (agent, state, since), journal,
                 None, reason, by, wait, keys, as_json, (temporal, namespace))


def _control_any(ctx: typer.Context, kind: ControlKind, delegation_id: str | None,
                 selectors: tuple[str | None, list[str] | None, str | None], journal: str,
                 grace: float | None, reason: str, by: str | None, wait: bool,
                 keys: Path | None, as_json: bool,
                 temporal: tuple[str | None, str]) -> None:
    query = selection(delegation_id, *selectors)
    if query is None:
        assert delegation_id is not None
        _control_cmd(kind, delegation_id, journal, grace, reason, by, wait, keys, as_json,
                     temporal)
        return
    if ctx.get_parameter_source("temporal") is ParameterSource.COMMANDLINE:
        raise UserError("--temporal stops one delegation's run: name its id")
    # $TEMPORAL_ADDRESS alone does not refuse a selection: its Temporal runs are fenced in the
    # journal (their activities refused) but not stopped in Temporal (README, "Temporal").
    if kind is ControlKind.RECALL:
        check_grace(grace, Policy())
    operator_of(by)  # a name nobody can read is refused before anything is signed
    control_many(kind, query, journal, grace, reason, by, wait, keys, as_json)


@app.command()
@cli_errors
def reconcile(delegation_id: Annotated[str | None, typer.Argument()] = None,
              journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
              tools: Annotated[list[str] | None, typer.Option(
                  "--tools", help="module:attribute of tools (or agents) whose probes to use "
                  "(default: $TETHER_TOOLS).")] = None,
              as_json: JsonOpt = False) -> None:
    """Reconcile delegations whose owner died, and every action still in doubt."""
    from tether._cli.render import render_report

    sys.path.insert(0, os.getcwd())
    # These, else what $TETHER_TOOLS names (the supervisor's default), before anything opens.
    loaded = list((load_tools(tools, "--tools") if tools else deployment_tools()).values())

    refused: dict[str, str] = {}
    undeclared: set[str] = set()

    async def go() -> list[dict[str, Any]]:
        j = Journal(journal, create=False)
        ring = await asyncio.to_thread(KeyRing.load, key_dir(j, keys))
        async with Supervisor(j, keys=ring, tools=loaded, recover=False) as sup:
            if delegation_id is not None:
                await j.get(delegation_id)  # an unknown id is a mistake, not "nothing to do"
            found = [r.to_json() for r in await sup.recover(delegation_id, refused)]
            undeclared.update(sup.undeclared_tools)
            return found

    reports = run(go())
    for name in sorted(undeclared):
        err.print(f"[yellow]warning:[/yellow] no tool named {safe(repr(name))} is declared, so "
                  f"its calls in doubt stay UNKNOWN: {safe(HOW)}", highlight=False,
                  soft_wrap=True)
    code = 1 if refused or any(needs_person(r) for r in reports) else 0
    if as_json:
        # A refused delegation is listed as such: its records fail their chain, so it has no
        # report to give (``tether verify`` names what changed).
        emit_json([*reports, *({"delegation_id": d, "outcome": "REFUSED", "error": why}
                               for d, why in sorted(refused.items()))])
        raise typer.Exit(code)
    for d, why in sorted(refused.items()):
        err.print(f"[red]refused[/red] {safe(d)}: {safe(why)} (see 'tether verify "
                  f"{safe(d)}')", highlight=False, soft_wrap=True)
    if refused and not reports:
        raise typer.Exit(code)
    if not reports:
        out.print("Nothing to reconcile: no orphaned delegation and no action in doubt.")
    for report in reports:
        render_report(out, report)
    raise typer.Exit(code)


@keys_app.command("init")
@cli_errors
def keys_init(journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
              as_json: JsonOpt = False) -> None:
    """Create a signing key and trust it."""
    directory = key_dir(Journal(journal), keys)
    ring = KeyRing.init(directory)
    if as_json:
        emit_json({"directory": str(directory), "signing": ring.signer.key_id})
        return
    out.print(f"signing key {safe(ring.signer.key_id)} written to {safe(directory)}",
              soft_wrap=True)


@keys_app.command("show")
@cli_errors
def keys_show(journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
              as_json: JsonOpt = False) -> None:
    """Show the signing key id and the trusted keys."""
    directory = key_dir(Journal(journal), keys)
    ring = KeyRing.load(directory)
    data = {"directory": str(directory), "signing": ring.signer.key_id,
            "public": ring.signer.public_b64(), "pinned": ring.trusted.ids(),
            "trusted": ring.trusted.ids()}  # "trusted": the pinned roots' earlier name
    if as_json:
        emit_json(data)
    else:
        for text in (f"keys in {directory}", f"signing key: {ring.signer.key_id}",
                     f"public key: {data['public']}",
                     "pinned root keys: " + ", ".join(ring.trusted.ids())):
            out.print(safe(text), soft_wrap=True)


@app.command()
@cli_errors
def worker(
    agents: Annotated[str, typer.Option("--agents", help="module:attribute naming an agent, "
                                        "a list of agents or a dict of them.")],
    journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1,
                                             help="Delegations run at once.")] = 16,
    lease: Annotated[float, typer.Option("--lease", help="Seconds; renewed every tenth.")]
    = 10.0,
    stop_timeout: Annotated[float, typer.Option(
        "--stop-timeout", help="On SIGTERM, seconds to let running delegations finish before "
        "terminating them.")] = 30.0,
    log_level: LogLevelOpt = "info", log_format: LogFormatOpt = "text",
) -> None:
    """Run queued delegations (``delegate(..., remote=True)``) in this process until SIGTERM or
    Ctrl-C. Exits 3 if the lease runs out (a long pause): its work is reconciled elsewhere."""
    import signal

    from tether._core.errors import LeaseLost
    from tether._runtime.worker import Worker, load_agents

    configure_logs(log_level, log_format)
    found = load_agents(agents)

    async def go() -> None:
        j = Journal(journal)
        ring = KeyRing.load_or_init(key_dir(j, keys))
        async with Worker(j, found, concurrency=concurrency, lease=lease, keys=ring,
                          stop_timeout=stop_timeout) as w:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, w.stop)
            print(plain(f"worker {w.owner_id} ready: {', '.join(sorted(found))} on "
                        f"{j.location}"), flush=True)
            await w.run()

    try:
        run(go())
    except LeaseLost as exc:
        err.print(f"[red]error:[/red] {safe(exc)}", highlight=False, soft_wrap=True)
        raise typer.Exit(3) from None


@app.command()
@cli_errors
def chaos(trials: Annotated[int, typer.Option("--trials", min=1)] = 50,
          seed: Annotated[int, typer.Option("--seed")] = 1,
          replay: Annotated[int | None, typer.Option(
              "--replay", help="Run only the trial with this trial seed (its recorded plan, "
              "if --traces holds it) and print its recorded trace beside the new one.")] = None,
          faults: Annotated[str | None, typer.Option(
              "--faults", help="Comma-separated fault kinds to draw from.")] = None,
          per_fault: Annotated[int | None, typer.Option(
              "--per-fault", min=1, help="Run this many trials of each chosen fault instead "
              "of --trials drawn among them.")] = None,
          journal: Annotated[str | None, typer.Option(
              "--journal", help="postgresql://... to run each trial in its own schema there "
              "(default: a SQLite file per trial).")] = None,
          traces: Annotated[Path, typer.Option(
              "--traces", help="Where failing trials' records (plan and observed schedule) "
              "are written, and where --replay reads them.")] = Path(".tether/chaos"),
          inject: Annotated[str | None, typer.Option(
              "--inject", help="A deliberate bug (of the simulated provider or the runtime), to "
              "check that chaos catches it: double_apply, blind_probe, overdue_apply or "
              "intent_after_dispatch.")] = None,
          trial_timeout: Annotated[float, typer.Option(
              "--trial-timeout", min=1.0, help="Seconds before a trial counts as hung.")] = 30.0,
          as_json: JsonOpt = False) -> None:
    """Crash, race, pause and fault trials, each judged against the outside world's ledger."""
    from rich.progress import Progress
    from rich.table import Table

    from tether._chaos.harness import run_chaos
    from tether._chaos.judge import CLASSES
    from tether._chaos.plan import ALL_FAULTS, BUGS, FAULTS
    from tether._chaos.trace import line
    from tether._cli.render import trials_table

    chosen = FAULTS if faults is None else tuple(f.strip() for f in faults.split(","))
    unknown = [f for f in chosen if f not in ALL_FAULTS]
    if unknown or not chosen:
        raise UserError(f"unknown fault kind(s) {', '.join(unknown)}; known: "
                        f"{', '.join(ALL_FAULTS)}")
    if inject is not None and inject not in BUGS:
        raise UserError(f"unknown --inject {inject!r}; known: {', '.join(BUGS)}")
    if journal is not None and not journal.startswith(("postgresql://", "postgres://")):
        raise UserError("--journal for chaos takes a postgresql:// URL; SQLite is the default")
    if journal is not None and "schema" in parse_qs(urlsplit(journal).query):
        raise UserError("--journal for chaos names a server, not a schema: each trial makes "
                        "its own schema there (drop schema= from the URL)")
    total = 1 if replay is not None else (
        trials if per_fault is None else per_fault * len(set(chosen)))
    with Progress(console=err, transient=True, disable=as_json) as bar:
        task = bar.add_task("chaos trials", total=total)
        result = run_chaos(trials, seed, chosen, replay, journal,
                           progress=lambda *_: bar.advance(task), per_fault=per_fault,
                           traces=traces, inject=inject or "", timeout=trial_timeout)
    # A trial whose orchestrator crashed judged nothing: the run proves nothing either.
    crashed = [t for t in result["trials_detail"] if t["outcome"] == "crashed"]
    failed = 1 if result["violations"] or crashed else 0
    if as_json:
        emit_json(result)
        raise typer.Exit(failed)
    title = (f"tether chaos: replay of trial {replay}" if replay is not None
             else f"tether chaos: {result['trials']} trials, seed {seed}")
    out.print(trials_table(title, result["faults"]))
    out.print("  ".join(f"{k}: {result['counts'][k]}" for k in CLASSES) + "  outcomes: "
              + ", ".join(f"{k} {n}" for k, n in sorted(result["outcomes"].items())))
    backend = "" if journal is None else f" --journal {journal}"
    injected = "" if inject is None else f" --inject {inject}"
    for v in result["violations"][:20]:
        out.print(f"[red]{safe(v['class'])}[/red] (fault {safe(v['fault'])}): "
                  f"{safe(v['detail'])} - replay with: tether chaos --replay "
                  f"{v['trial_seed']}{safe(backend)}{safe(injected)}", highlight=False)
    for t in crashed[:5]:
        out.print(f"[red]crashed[/red] (fault {safe(t['fault'])}, trial {t['trial_seed']}): "
                  f"{safe(t.get('error', ''))}", highlight=False)
    for path in result["records"][:5]:
        out.print(f"recorded: {safe(path)}", highlight=False)
    if replay is not None:
        recorded = result["replay_of"]
        new = result["trials_detail"][0]["trace"]
        old = recorded.get("trace", []) if recorded else []
        side = Table(title=f"recorded run (left, {len(old)} events) and this run "
                           f"(right, {len(new)} events)", show_lines=False)
        side.add_column("recorded", overflow="fold")
        side.add_column("replayed", overflow="fold")
        for i in range(max(len(old), len(new))):
            side.add_row(safe(line(old[i])) if i < len(old) else "",
                         safe(line(new[i])) if i < len(new) else "")
        out.print(side)
        if recorded is not None and (recorded["plan"].get("bug") or None) != inject:
            out.print(safe(f"note: recorded with --inject "
                           f"{recorded['plan'].get('bug') or 'nothing'}, replayed with --inject "
                           f"{inject or 'nothing'}"), highlight=False)
        if recorded is None:
            out.print(f"no record of trial {replay} in {safe(traces)}: the plan came from the seed "
                      "alone and there is nothing to compare with", highlight=False)
        elif result["divergence"] is None:
            out.print("the two runs saw the same events in the same order", highlight=False)
        else:
            d = result["divergence"]
            out.print(safe(f"the runs part at event {d['index']}: recorded "
                           f"{line(d['recorded'])!r}, replayed {line(d['replayed'])!r}"),
                      highlight=False)
    raise typer.Exit(failed)


@trace_app.command("show")
@cli_errors
def trace_show(ident: Annotated[str, typer.Argument(help="Task id or delegation id.")],
               journal: JournalOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """A task's timeline across its attempts: lifecycle events and decisions."""
    from tether._cli.trace import render_timeline, timeline

    async def go() -> dict[str, Any]:
        async with Journal(journal, create=False) as j:
            return await timeline(j, ident)

    data = run(go())
    if as_json:
        emit_json(data)
    else:
        render_timeline(out, data)


@trace_app.command("analyze")
@cli_errors
def trace_analyze(journal: JournalOpt = DEFAULT_URL, as_json: JsonOpt = False,
                  failure: Annotated[str, typer.Option(
                      "--failure", help="Failure code prefix to study.")] = "stream_cut",
                  ) -> None:
    """Failures by lifetime, nesting depth, model and surface, against the base rate."""
    from tether._cli.trace import forensics, render_forensics

    async def go() -> dict[str, Any]:
        async with Journal(journal, create=False) as j:
            return await forensics(j, failure)

    data = run(go())
    if as_json:
        emit_json(data)
    else:
        render_forensics(out, data)


def _register_sim() -> None:
    from tether._cli.sim import sim

    app.command("sim")(cli_errors(sim))


_register_sim()


def _register_mcp() -> None:
    from tether._cli.mcp import mcp_proxy

    app.command("mcp-proxy")(cli_errors(mcp_proxy))


_register_mcp()


def _register_keys() -> None:
    from tether._cli.keys import register

    register(keys_app, out, cli_errors, emit_json)
    from tether._cli.verify import register as register_verify

    register_verify(app, out, cli_errors, emit_json)


_register_keys()


def _register_ops() -> None:
    from tether._cli import console, ops, retention

    ops.register(app, cli_errors)
    retention.register(app, cli_errors)
    console.register(app, cli_errors)


_register_ops()


def main() -> None:
    app()
