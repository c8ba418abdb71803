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


def sim(trials: Annotated[str, typer.Option("--trials", help="How many trials.")] = "1000",
        seed: Annotated[str, typer.Option("--seed", help="The run's seed: every trial's "
                                          "seed follows from it.")] = "1",
        faults: Annotated[str | None, typer.Option(
            "--faults", help="Comma-separated faults to draw from (default: all).")] = None,
        replay: Annotated[str | None, typer.Option(
            "--replay", help="Run only the trial with this trial seed and print its trace, "
            "one line per step (give the same --faults).")] = None,
        without: Annotated[str | None, typer.Option(
            "--without", help="Remove rules from the simulator's model of the journal "
            "(comma-separated, see docs/simulator.md), to show the defects they fixed.")] = None,
        engine: Annotated[str, typer.Option(
            "--engine", help="mirror: the simulator's own model of the runtime and journal; "
            "production: the production Supervisor, Worker and journal on the simulator's "
            "loop (docs/simulator.md).")] = "mirror",
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Deterministic simulation of tether's protocol core: crashes, pauses, late applies,
    lost replies and commits, failing probes, skewed clocks and control races, from one seed."""
    from tether._sim.journal import FIXES
    from tether._sim.trial import CLASSES, run_sim
    from tether._sim.world import FAULTS

    n = _integer(trials, "--trials")
    if n <= 0:
        raise UserError(f"--trials must be a positive integer, got {n}")
    run_seed = _integer(seed, "--seed")
    chosen = tuple(_names(faults, FAULTS, "fault kind(s)")) or FAULTS
    fixes = frozenset(FIXES) - frozenset(_names(without, sorted(FIXES), "rule(s)"))
    trial = None if replay is None else _integer(replay, "--replay")
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if engine == "production" and without is not None:
        raise UserError("--without removes rules from the mirror's model; the production "
                        "engine runs the code as it is")
    result = run_sim(n, run_seed, chosen, trial, fixes=fixes, engine=engine)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
        raise typer.Exit(1 if result["violations"] else 0)
    if trial is not None:
        for line in result["trace"]:
            out.print(line, highlight=False, markup=False, soft_wrap=True)
    _summary(result, run_seed, chosen, fixes, CLASSES)
    raise typer.Exit(1 if result["violations"] else 0)


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
    if result.get("engine") == "production":
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
