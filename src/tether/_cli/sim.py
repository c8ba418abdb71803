"""``tether sim``: the production supervisors, workers and journal on a deterministic loop in
virtual time, with simulated providers and faults, each trial judged against the providers'
ledgers."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console

from tether._cli.render import trials_table
from tether._cli.safe import safe
from tether._core.errors import UserError

out = Console()


def _integer(value: str, name: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise UserError(f"{name} must be an integer, got {value!r}") from None


def _names(value: str | None, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    if value is None:
        return []
    chosen = [f.strip() for f in value.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in known]
    if unknown or not chosen:
        raise UserError(f"unknown {what} {', '.join(unknown) or repr(value)}; "
                        f"known: {', '.join(known)}")
    return list(dict.fromkeys(chosen))


def sim(trials: Annotated[str | None, typer.Option(
            "--trials", help="How many trials (default 1000, or a mutation's own).")] = None,
        seed: Annotated[str | None, typer.Option(
            "--seed", help="The run's seed: every trial's seed follows from it (default 1, "
            "or a mutation's own).")] = None,
        faults: Annotated[str | None, typer.Option(
            "--faults", help="Comma-separated faults to draw from (default: all).")] = None,
        replay: Annotated[str | None, typer.Option(
            "--replay", help="Run only the trial with this trial seed and print its trace, "
            "one line per step (give the same --faults).")] = None,
        mutate: Annotated[str | None, typer.Option(
            "--mutate", help="Put this fixed defect back in the code that ships for the run "
            "(docs/simulator.md lists them); by default on the mutation's own faults, seed "
            "and trials.")] = None,
        mutations: Annotated[bool, typer.Option(
            "--mutations", help="Run the whole catalogue of mutations; exit 1 unless each is "
            "found within its stated trials.")] = False,
        jobs: Annotated[str | None, typer.Option(
            "--jobs", help="Worker processes to run the trials in (default 1); the result is "
            "the same, trial for trial.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Deterministic simulation of the production runtime and journal: crashes, pauses, late
    applies, lost replies, commits and notifications, failing probes, skewed clocks and
    control races, from one seed."""
    from tether._sim.judge import CLASSES
    from tether._sim.mutations import BY_NAME
    from tether._sim.runs import run_sim
    from tether._sim.world import FAULTS

    if mutations:
        given = [name for name, value in (("--mutate", mutate), ("--replay", replay),
                                          ("--trials", trials), ("--seed", seed),
                                          ("--faults", faults), ("--jobs", jobs))
                 if value is not None]
        if given:
            raise UserError("--mutations runs the catalogue, each mutation on its own faults, "
                            f"seed and trials; give no {', '.join(given)} with it")
        _catalogue(as_json)
    if replay is not None and (trials is not None or seed is not None or jobs is not None):
        raise UserError("--replay runs the one trial its seed names; give no --trials, --seed "
                        "or --jobs with it (only the run's --faults)")
    workers = _integer(jobs, "--jobs") if jobs is not None else 1
    if workers <= 0:
        raise UserError(f"--jobs must be a positive integer, got {workers}")
    m = None
    if mutate is not None:
        m = BY_NAME.get(mutate.strip())
        if m is None:
            raise UserError(f"unknown mutation {mutate!r}; known: {', '.join(BY_NAME)}")
    n = _integer(trials, "--trials") if trials is not None else (m.within if m else 1000)
    if n <= 0:
        raise UserError(f"--trials must be a positive integer, got {n}")
    run_seed = _integer(seed, "--seed") if seed is not None else (m.seed if m else 1)
    chosen = tuple(_names(faults, FAULTS, "fault kind(s)")) or (m.faults if m else FAULTS)
    trial = None if replay is None else _integer(replay, "--replay")
    result = run_sim(n, run_seed, chosen, trial, edits=m.edits if m else (), jobs=workers)
    result["mutation"] = None if m is None else m.name
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
        raise typer.Exit(1 if result["violations"] else 0)
    if trial is not None:
        for line in result["trace"]:
            out.print(line, highlight=False, markup=False, soft_wrap=True)
    _summary(result, run_seed, chosen, CLASSES)
    raise typer.Exit(1 if result["violations"] else 0)


def _catalogue(as_json: bool) -> None:
    """Each mutation of the catalogue, hunted on its own run: where it was found."""
    from rich.table import Table

    from tether._sim.mutations import CATALOGUE, hunt

    rows: list[dict[str, Any]] = []
    for m in CATALOGUE:
        found = hunt(m)
        rows.append({"mutation": m.name, "defect": m.defect, "faults": list(m.faults),
                     "seed": m.seed, "within": m.within, "found": found.found,
                     "trials": found.trials, "trial_seed": found.trial_seed,
                     "classes": list(found.classes)})
    missed = [r["mutation"] for r in rows if not r["found"]]
    if as_json:
        sys.stdout.write(json.dumps({"mutations": rows, "missed": missed}, indent=2) + "\n")
        raise typer.Exit(1 if missed else 0)
    table = Table(title="tether sim --mutations: each fixed defect put back, and found")
    for column in ("mutation", "found in trial", "within", "judged"):
        table.add_column(column, no_wrap=column == "mutation")
    for r in rows:
        table.add_row(r["mutation"], str(r["trials"]) if r["found"] else "[red]not found[/red]",
                      str(r["within"]), ", ".join(r["classes"]))
    out.print(table)
    for r in rows:
        if r["found"]:
            out.print(f"replay: tether sim --mutate {r['mutation']} --replay {r['trial_seed']}",
                      highlight=False, soft_wrap=True)
    if missed:
        out.print(f"[red]not found within their trials:[/red] {', '.join(missed)}")
    raise typer.Exit(1 if missed else 0)


def _summary(result: dict[str, Any], seed: int, chosen: tuple[str, ...],
             classes: tuple[str, ...]) -> None:
    from tether._sim.world import FAULTS

    title = (f"tether sim: replay of trial {result['replay']}" if result["replay"] is not None
             else f"tether sim: {result['trials']} trials, seed {seed}")
    out.print(trials_table(title, result["faults"]))
    counts = result["counts"]
    out.print("  ".join(f"{k}: {counts[k]}" for k in (*classes, "error")), highlight=False,
              soft_wrap=True)
    rate = result["trials_per_minute"]
    out.print(f"{result['trials']} trials in {result['elapsed_s']:.2f} s"
              + (f" ({rate:,} trials/minute)" if rate else ""), highlight=False)
    extra = f" --mutate {result['mutation']}" if result.get("mutation") else ""
    for v in result["violations"][:20]:
        active = v["faults"] or list(chosen)
        selection = "" if tuple(active) == FAULTS else f" --faults {','.join(active)}"
        out.print(f"[red]{safe(v['class'])}[/red] (faults {safe(v['fault'])}): "
                  f"{safe(v['detail'])} - replay with: tether sim --replay "
                  f"{v['trial_seed']}{safe(selection)}{safe(extra)}",
                  highlight=False, soft_wrap=True)
    if len(result["violations"]) > 20:
        out.print(f"... and {len(result['violations']) - 20} more (--json lists them all)")
