"""``tether sim``: many simulated orchestrators, workers and providers in virtual time, driving
tether's pure core, each trial judged against the providers' ledgers."""

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
ENGINES = ("mirror", "production")


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
        without: Annotated[str | None, typer.Option(
            "--without", help="Remove rules from the simulator's model of the journal "
            "(comma-separated, see docs/simulator.md), to show the defects they fixed.")] = None,
        engine: Annotated[str | None, typer.Option(
            "--engine", help="mirror (the default): the simulator's own model of the runtime "
            "and journal; production: the production Supervisor, Worker and journal on the "
            "simulator's loop (docs/simulator.md).")] = None,
        mutate: Annotated[str | None, typer.Option(
            "--mutate", help="Run the production engine with this fixed defect put back in "
            "the code that ships (docs/simulator.md lists them); by default on the "
            "mutation's own faults, seed and trials.")] = None,
        mutations: Annotated[bool, typer.Option(
            "--mutations", help="Run the whole catalogue of mutations; exit 1 unless each is "
            "found within its stated trials.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Deterministic simulation of tether's protocol core: crashes, pauses, late applies,
    lost replies and commits, failing probes, skewed clocks and control races, from one seed."""
    from tether._sim.journal import FIXES
    from tether._sim.mutate import applied
    from tether._sim.mutations import BY_NAME
    from tether._sim.trial import CLASSES, run_sim
    from tether._sim.world import FAULTS

    if mutations:
        if mutate is not None or without is not None or replay is not None \
                or engine == "mirror":
            raise UserError("--mutations runs the catalogue on the production engine, each "
                            "mutation on its own run; give no --mutate, --without, --replay "
                            "or --engine mirror with it")
        _catalogue(as_json)
    m = None
    if mutate is not None:
        m = BY_NAME.get(mutate.strip())
        if m is None:
            raise UserError(f"unknown mutation {mutate!r}; known: {', '.join(BY_NAME)}")
        if engine == "mirror" or without is not None:
            raise UserError("--mutate puts a defect back in the code that ships: it runs the "
                            "production engine, without --without or --engine mirror")
        engine = "production"
    engine = engine or "mirror"
    n = _integer(trials, "--trials") if trials is not None else (m.within if m else 1000)
    if n <= 0:
        raise UserError(f"--trials must be a positive integer, got {n}")
    run_seed = _integer(seed, "--seed") if seed is not None else (m.seed if m else 1)
    chosen = tuple(_names(faults, FAULTS, "fault kind(s)")) or (m.faults if m else FAULTS)
    fixes = frozenset(FIXES) - frozenset(_names(without, sorted(FIXES), "rule(s)"))
    trial = None if replay is None else _integer(replay, "--replay")
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if engine == "production" and without is not None:
        raise UserError("--without removes rules from the mirror's model; the production "
                        "engine runs the code as it is")
    with applied(*(m.edits if m else ())):
        result = run_sim(n, run_seed, chosen, trial, fixes=fixes, engine=engine)
    result["mutation"] = None if m is None else m.name
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
        raise typer.Exit(1 if result["violations"] else 0)
    if trial is not None:
        for line in result["trace"]:
            out.print(line, highlight=False, markup=False, soft_wrap=True)
    _summary(result, run_seed, chosen, fixes, CLASSES)
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
             fixes: frozenset[str], classes: tuple[str, ...]) -> None:
    from tether._sim.journal import FIXES
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
    removed = sorted(set(FIXES) - fixes)
    extra = "" if not removed else f" --without {','.join(removed)}"
    if result.get("mutation"):
        extra += f" --mutate {result['mutation']}"
    elif result.get("engine") == "production":
        extra += " --engine production"
    for v in result["violations"][:20]:
        active = v["faults"] or list(chosen)
        selection = "" if tuple(active) == FAULTS else f" --faults {','.join(active)}"
        out.print(f"[red]{safe(v['class'])}[/red] (faults {safe(v['fault'])}): "
                  f"{safe(v['detail'])} - replay with: tether sim --replay "
                  f"{v['trial_seed']}{safe(selection)}{safe(extra)}",
                  highlight=False, soft_wrap=True)
    if len(result["violations"]) > 20:
        out.print(f"... and {len(result['violations']) - 20} more (--json lists them all)")
