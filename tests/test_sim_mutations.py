"""The mutation catalogue (``tether._sim.mutations``): fixed defects put back in the code that
ships, each found by the production engine on its stated run. The whole catalogue is
``tether sim --mutations``; here each entry's finding trial is run with and without it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tether._cli.app import app
from tether._core import outcome
from tether._core.model import ActionState, ProbeOutcome
from tether._runtime import reconcile
from tether._sim import trial as production
from tether._sim.mutate import Edit, MutationStale, applied, changed
from tether._sim.mutations import CATALOGUE, UNCAUGHT, Mutation, hunt
from tether._sim.plan import trial_seed

runner = CliRunner()


@pytest.mark.parametrize("m", list(CATALOGUE), ids=lambda m: m.name)
def test_each_mutation_is_found_in_its_trial_and_that_trial_is_clean_without_it(
        m: Mutation) -> None:
    assert m.found_in is not None and m.found_in <= m.within
    seed = trial_seed(m.seed, m.found_in - 1)
    with applied(*m.edits):
        found = production.run_trial(seed, m.faults).violations
    if not found:
        # A change of the runtime moves every trial's interleaving: the stated run must still
        # find it within its trials (then ``found_in`` is to be updated to the new figure).
        hunted = hunt(m)
        assert hunted.found, f"{m.name} is not found within {m.within} trials any more"
        assert hunted.trial_seed is not None
        seed = hunted.trial_seed
    assert production.run_trial(seed, m.faults).violations == []  # the defect, not the trial


@pytest.mark.parametrize("m", [*CATALOGUE, *UNCAUGHT], ids=lambda m: m.name)
def test_every_edit_still_applies_to_the_code_that_ships(m: Mutation) -> None:
    for edit in m.edits:
        assert changed(edit)  # raises MutationStale when the text is gone


def test_an_edit_runs_in_every_caller_and_is_undone_after() -> None:
    """The code of the function itself is swapped, so a caller that imported it by name
    (``reconcile`` imports ``judge_probe`` from ``_core.outcome``) runs the edit too."""
    edit = Edit("tether._core.outcome", "    if answer is ProbeOutcome.COMPLETED:\n"
                "        return _A.COMPLETED", "    if True:\n        return _A.COMPLETED")
    before = outcome.judge_probe.__code__
    judge = reconcile.probe_all.__globals__["judge_probe"]  # the name reconcile calls it by

    def unknown() -> ActionState:
        return judge(ProbeOutcome.UNKNOWN, voided=False, deadline_at=0.0, now=10.0,  # type: ignore[no-any-return]
                     tolerance=1.0)

    with applied(edit):
        assert unknown() is ActionState.COMPLETED
    assert outcome.judge_probe.__code__ is before
    assert unknown() is ActionState.UNKNOWN


def test_an_edit_whose_text_is_gone_is_refused() -> None:
    with pytest.raises(MutationStale), applied(Edit("tether._core.outcome", "no such text", "")):
        pass


@pytest.mark.parametrize(("args", "says"), [
    (["--mutate", "nope"], "unknown mutation"),
    (["--mutations", "--mutate", "intent_fence"], "--mutations"),
    (["--mutations", "--faults", "bogus"], "--faults with it"),
    (["--mutations", "--seed", "x"], "--seed with it"),
])
def test_cli_mutation_bad_input_is_one_line(args: list[str], says: str) -> None:
    result = runner.invoke(app, ["sim", "--trials", "1", *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], lines


def test_cli_mutate_runs_the_production_engine_with_the_defect() -> None:
    m = CATALOGUE[0]
    assert m.found_in is not None
    result = runner.invoke(app, ["sim", "--mutate", m.name, "--trials", str(m.found_in),
                                 "--json"])
    assert result.exit_code == 1, result.output  # found: a violation
    assert '"mutation": "intent_fence"' in result.stdout
