"""``Supervisor.recall_many`` and ``terminate_many``: many delegations stopped at once (a
storm), each answered on its own, and bad input refused before anything is written."""

from __future__ import annotations

import asyncio

import pytest

import tether
from tether.errors import NotFound, UserError
from tether.testing import VirtualClock


async def _idle(ctx: tether.Context) -> None:
    await asyncio.Event().wait()


async def _quick(ctx: tether.Context) -> str:
    return "done"


async def test_each_delegation_recalled_at_once_gets_its_own_answer(
        sup: tether.Supervisor, clock: VirtualClock) -> None:
    """Live children are recalled, one that finished keeps its report, an unknown id is that
    id's error alone, and a handle given twice is recalled once."""
    live = [await sup.delegate(_idle) for _ in range(4)]
    done = await sup.delegate(_quick)
    await done.result()
    clock.autojump()
    answers = await sup.recall_many([*live, live[0], done.id, "d_nobody"], grace=1.0,
                                    reason="storm")
    assert list(answers) == [*(h.id for h in live), done.id, "d_nobody"]
    for h in live:
        report = answers[h.id]
        assert isinstance(report, tether.Report)
        assert report.outcome is tether.DelegationState.RECALLED
    finished = answers[done.id]
    assert isinstance(finished, tether.Report)
    assert finished.outcome is tether.DelegationState.SUCCEEDED
    assert isinstance(answers["d_nobody"], NotFound)
    controls = [c for h in live for c in await sup.journal.controls(h.id)]
    assert len(controls) == len(live)  # one intent each


async def test_terminate_many_kills_each_now(sup: tether.Supervisor,
                                             clock: VirtualClock) -> None:
    live = [await sup.delegate(_idle) for _ in range(3)]
    clock.autojump()
    answers = await sup.terminate_many([h.id for h in live], reason="stop")
    assert {a.outcome for a in answers.values() if isinstance(a, tether.Report)} == \
        {tether.DelegationState.TERMINATED}
    assert len(answers) == 3


@pytest.mark.parametrize("bad", [
    "d_one",  # a single id, not a list of them
    [""],
    [None],
    [3],
    7,
])
async def test_bad_input_is_refused_and_nothing_is_stopped(
        sup: tether.Supervisor, bad: object) -> None:
    child = await sup.delegate(_idle)
    with pytest.raises(UserError):
        await sup.recall_many(bad, grace=1.0)  # type: ignore[arg-type]
    with pytest.raises(UserError):
        await sup.terminate_many(bad)  # type: ignore[arg-type]
    with pytest.raises(UserError):
        await sup.recall_many([child], grace=-1.0)
    with pytest.raises(UserError):
        await sup.recall_many([child], grace=1.0, reason=5)  # type: ignore[arg-type]
    assert await sup.journal.controls(child.id) == []
    assert (await sup.journal.get(child.id)).state is tether.DelegationState.RUNNING
    await child.terminate()
