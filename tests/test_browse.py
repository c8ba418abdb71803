"""The console's reads (``_journal.browse``), on SQLite and PostgreSQL: keyset pages that reach
every row once in either direction, rows created at the same instant included; filters by
state, agent, tool and time; a search by id, prefix or key; counts by state; ancestors."""

from __future__ import annotations

import asyncio
from typing import Any

import tether
from tether._core.model import ActionState, DelegationState, Effect
from tether._journal import browse
from tether._journal.rows import NewAction, NewDelegation


async def _world(j: tether.Journal) -> list[str]:
    """23 delegations, three at each instant; every 4th failed; every 3rd of agent "b"; each
    with one call to "pay" or "mail"; the last a child of the first."""
    ids = [f"d_{i:03d}" for i in range(23)]

    async def one(i: int) -> None:
        parent = ids[0] if i == 22 else None
        await j.create_delegation(NewDelegation(
            id=ids[i], task_id=f"t_{i:03d}", parent_id=parent, attempt=1,
            agent="b" if i % 3 == 0 else "a", surface=(), args={}, owner_id="o",
            now=100.0 + i // 3, parent_epoch=0 if parent else None))
        tool = "pay" if i % 2 else "mail"
        await j.begin_action(NewAction(
            id=f"a_{i:03d}", delegation_id=ids[i], epoch=0, ordinal=0, tool=tool,
            effect=Effect.EXTERNAL, args_json="{}", args_hash=f"h{i}", idem_key=f"k-{i}",
            now=100.0 + i // 3, deadline_at=200.0))
        j.finish_action(f"a_{i:03d}", ActionState.COMPLETED, 101.0 + i // 3, {"n": i})

    for i in range(22):
        await one(i)
    await one(22)
    await asyncio.gather(*(j.end_delegation(ids[i], DelegationState.FAILED, 120.0)
                           for i in range(1, 22, 4)))
    await j.flush()
    return ids


def _ids(page: browse.Page) -> list[str]:
    return [browse.row_id(r) for r in page.rows]


async def _walk(j: tether.Journal, read: Any, q: browse.Browse) -> list[str]:
    seen: list[str] = []
    page = await j.peek(read, q)
    seen.extend(_ids(page))
    pages = [page]
    while page.more_older:
        page = await j.peek(read, browse.Browse(**{**q.__dict__, "older": _ids(page)[-1]}))
        seen.extend(_ids(page))
        pages.append(page)
    # And back from the last page, by its first row: the same pages, in reverse.
    back = [pages[-1]]
    while back[-1].more_newer:
        back.append(await j.peek(read, browse.Browse(
            **{**q.__dict__, "newer": _ids(back[-1])[0]})))
    assert [_ids(p) for p in reversed(back)] == [_ids(p) for p in pages]
    assert not pages[0].more_newer
    return seen


async def test_pages_reach_every_row_once_either_way(journal_url: str) -> None:
    async with tether.Journal(journal_url) as j:
        ids = await _world(j)
        newest = sorted(ids, key=lambda d: (100 + int(d[2:]) // 3, d), reverse=True)
        assert await _walk(j, browse.delegations, browse.Browse(limit=5)) == newest
        calls = await _walk(j, browse.actions, browse.Browse(limit=4, oldest_first=True))
        assert calls == [f"a_{d[2:]}" for d in reversed(newest)]
        page = await j.peek(browse.delegations, browse.Browse(limit=5))
        assert page.total == 23 and page.counts == {"FAILED": 6, "RUNNING": 17}


async def test_filters_and_search(journal_url: str) -> None:
    async with tether.Journal(journal_url) as j:
        ids = await _world(j)

        async def found(**kw: Any) -> list[str]:
            return sorted(_ids(await j.peek(browse.delegations, browse.Browse(**kw))))

        assert await found(states=("FAILED",), agent="b") == ["d_009", "d_021"]
        assert await found(tool="pay", since=105.0, until=106.0) == ["d_015", "d_017"]
        assert await found(search="k-7") == ["d_007"]  # a key names its delegation
        assert await found(search="a_008") == ["d_008"]  # so does an action id
        assert await found(search="d_01") == [f"d_{i:03d}" for i in range(10, 20)]
        assert await found(search="d_0_") == []  # a LIKE wildcard is a character here
        acts = await j.peek(browse.actions, browse.Browse(tool="mail", agent="b"))
        assert sorted(_ids(acts)) == ["a_000", "a_006", "a_012", "a_018"]
        assert await j.peek(browse.locate, "k-3") == "d_003"
        assert await j.peek(browse.locate, "nothing") is None
        assert [d.id for d in await j.peek(browse.lineage, ids[22])] == ["d_000"]
        assert await j.peek(browse.action_counts, ["d_001", "d_002"]) == {
            "d_001": {"COMPLETED": 1}, "d_002": {"COMPLETED": 1}}
        assert await j.peek(browse.attention_count) == 0
