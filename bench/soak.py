"""A long soak: waves of children act, half are recalled mid-flight, for as long as asked.

    .venv/bin/python bench/soak.py --minutes 10 [--children 200]

After every wave it samples the process's resident memory and open file descriptors; it prints
how they moved and exits 1 if memory grew more than 20% between the first and last fifth of the
run, or file descriptors grew at all. One supervisor and one journal live through the whole run,
as in a long-lived service.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time

import tether


@tether.tool(effect=tether.Effect.EXTERNAL)
async def act(i: int, *, idempotency_key: str) -> int:
    await asyncio.sleep(0.001)
    return i


async def worker(ctx: tether.Context, n: int) -> None:
    for i in range(n):
        await ctx.call(act, i=i)


def rss_kib() -> int:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() // 1024


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def soak(minutes: float, children: int) -> int:
    samples: list[tuple[float, int, int]] = []
    deadline = time.monotonic() + minutes * 60
    waves = 0
    with tempfile.TemporaryDirectory() as tmp:
        async with tether.Supervisor(f"sqlite:///{tmp}/soak.db",
                                     keys=tether.KeyRing.ephemeral()) as sup:
            while time.monotonic() < deadline:
                handles = await asyncio.gather(
                    *(sup.delegate(worker, 10, tools=[act]) for _ in range(children)))
                await asyncio.gather(*(h.recall(grace=1.0) for h in handles[: children // 2]))
                for h in handles:
                    await h.wait()
                waves += 1
                samples.append((time.monotonic(), rss_kib(), fds()))
    fifth = max(1, len(samples) // 5)
    first = statistics.median(s[1] for s in samples[:fifth])
    last = statistics.median(s[1] for s in samples[-fifth:])
    fd_first, fd_last = samples[0][2], samples[-1][2]
    growth = (last - first) / first
    print(f"waves: {waves}  children: {waves * children}  actions: {waves * children * 10}")
    print(f"rss KiB: first fifth {first:.0f}, last fifth {last:.0f} ({growth:+.1%})")
    print(f"open fds: first {fd_first}, last {fd_last}")
    return 1 if growth > 0.20 or fd_last > fd_first else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--children", type=int, default=200)
    args = parser.parse_args()
    return asyncio.run(soak(args.minutes, args.children))


if __name__ == "__main__":
    sys.exit(main())
