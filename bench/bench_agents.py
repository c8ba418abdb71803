"""The agent a benchmark worker runs: it thinks (waits) until it is recalled."""

from __future__ import annotations

import asyncio

import tether


@tether.agent(tools=[])
async def thinker(ctx: tether.Context) -> None:
    await asyncio.Event().wait()


AGENTS = [thinker]
