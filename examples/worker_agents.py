"""Agents shared by the orchestrator and its workers (both import this module)."""

from __future__ import annotations

import asyncio

import tether


@tether.tool(effect=tether.Effect.READ_ONLY)
async def fetch(kind: str) -> str:
    if kind == "forever":
        await asyncio.Event().wait()  # a long model call, say
    return f"{kind} numbers"


@tether.agent(tools=[fetch])
async def slow_report(ctx: tether.Context, kind: str) -> str:
    return f"report on {await ctx.call(fetch, kind=kind)}"


AGENTS = [slow_report]
