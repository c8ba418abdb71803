"""tether's benchmarks against the anchors: one durable SQLite commit and DBOS.

Run from the repository root, after the README's setup:
    .venv/bin/pip install -r bench/requirements.txt     # the DBOS anchor (bench only)
    .venv/bin/python bench/run.py [--quick] [--check]

Every figure is measured in this run, on this machine, side by side with its baseline; absolute
times drift 20-30% between runs here, ratios much less. Writes bench/results/latest.json (with a
``targets`` list a script can read) and bench/results/latest.md. ``--check`` exits 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import tether

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_operator import operator_figures

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@tether.tool(effect=tether.Effect.EXTERNAL)
async def noop(i: int, *, idempotency_key: str) -> int:
    return i


async def actor(ctx: tether.Context, n: int) -> None:
    for i in range(n):
        await ctx.call(noop, i=i)


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def commit_cost(directory: Path, n: int, rows: int = 1) -> float:
    """Seconds per durable commit of ``rows`` rows (WAL, synchronous=FULL)."""
    path = directory / f"commit-{rows}-{time.monotonic_ns()}.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    start = time.perf_counter()
    for _ in range(n):
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO t (v) VALUES (?)", [("x" * 64,)] * rows)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed / n


PG = os.environ.get("TETHER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")


def pg_commit_cost(n: int) -> float | None:
    """Seconds per durable single-row autocommit INSERT on PostgreSQL (None: no server)."""
    try:
        import psycopg
    except ImportError:
        return None
    try:
        conn = psycopg.connect(PG, autocommit=True, connect_timeout=3)
    except psycopg.Error:
        return None
    # A real table: a TEMP one writes no WAL and syncs nothing, so it is no durable commit.
    table = f'"bench_anchor_{os.getpid()}_{time.monotonic_ns()}"'
    with conn:
        conn.execute(f"CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, v TEXT)")
        try:
            conn.execute(f"INSERT INTO {table} (v) VALUES (%s)", ("warm",))
            start = time.perf_counter()
            for _ in range(n):
                conn.execute(f"INSERT INTO {table} (v) VALUES (%s)", ("x" * 64,))
            return (time.perf_counter() - start) / n
        finally:
            conn.execute(f"DROP TABLE {table}")


async def pg_sequential(n: int) -> float:
    schema = f"bench_{os.getpid()}_{time.monotonic_ns()}"
    url = f"{PG}?schema={schema}&keys={tempfile.mkdtemp()}"
    try:
        return await per_action(url, n)
    finally:
        import psycopg

        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def journal_url(directory: Path, name: str, sync: str = "full") -> str:
    return f"sqlite:///{directory / name}?synchronous={sync}"


async def sequential(directory: Path, n: int) -> float:
    return await per_action(journal_url(directory, f"seq-{time.monotonic_ns()}.db"), n)


async def per_action(url: str, n: int) -> float:
    """Seconds per action: one child, back-to-back EXTERNAL actions, durable."""
    async with tether.Supervisor(url, keys=tether.KeyRing.ephemeral()) as sup:
        warm = await sup.delegate(actor, 10, tools=[noop])
        await warm.result()
        handle = await sup.delegate(actor, n, tools=[noop])
        start = time.perf_counter()
        await handle.result()
        return (time.perf_counter() - start) / n


async def concurrent(directory: Path, children: int, actions: int,
                     sync: str = "full") -> tuple[float, float]:
    """(actions per second, CPU seconds per action) for ``children`` concurrent children."""
    url = journal_url(directory, f"conc-{time.monotonic_ns()}.db", sync)
    async with tether.Supervisor(url, keys=tether.KeyRing.ephemeral()) as sup:
        wall, cpu = time.perf_counter(), time.process_time()
        handles = await asyncio.gather(
            *(sup.delegate(actor, actions, tools=[noop]) for _ in range(children)))
        await asyncio.gather(*(h.result() for h in handles))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    total = children * actions
    return total / wall, cpu / total


def blocked() -> tuple[asyncio.Event, tether.Tool, Callable[[tether.Context], Awaitable[None]]]:
    """A child that waits in a read until the gate opens: live, and with nothing in flight."""
    gate = asyncio.Event()

    @tether.tool(effect=tether.Effect.READ_ONLY)
    async def wait() -> None:
        await gate.wait()

    async def waiter(ctx: tether.Context) -> None:
        await ctx.call(wait)

    return gate, wait, waiter


def in_flight() -> tuple[asyncio.Event, tether.Tool, Callable[[tether.Context], Awaitable[None]]]:
    """A child that makes two EXTERNAL calls, the first held until the event is set: a storm's
    child, with an action in flight when it is recalled and one its fence refuses."""
    release = asyncio.Event()

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def slow(*, idempotency_key: str) -> None:
        await release.wait()

    async def busy(ctx: tether.Context) -> None:
        await ctx.call(slow)
        await ctx.call(slow)

    return release, slow, busy


def fence_times(sup: tether.Supervisor) -> dict[str, float]:
    """When each delegation's fence was durably closed (its 'drain' event), by id."""
    fenced: dict[str, float] = {}

    def on_event(event: str, delegation_id: str) -> None:
        if event == "drain":
            fenced.setdefault(delegation_id, time.perf_counter())

    sup.listen(on_event)
    return fenced


async def recall_latency(directory: Path, n: int) -> list[float]:
    """Seconds from recall() to the fence durably closed, for ``n`` children one after the
    other. The supervisor's 'drain' event fires right after the journal committed the intent
    and its fence; from then on a new call is refused."""
    gate, wait, waiter = blocked()

    samples: list[float] = []
    async with tether.Supervisor(journal_url(directory, f"rl-{time.monotonic_ns()}.db"),
                                 keys=tether.KeyRing.ephemeral()) as sup:
        fenced = fence_times(sup)
        handles = await asyncio.gather(*(sup.delegate(waiter, tools=[wait]) for _ in range(n)))
        for handle in handles:
            start = time.perf_counter()
            await handle.recall(grace=5.0)
            samples.append(fenced[handle.id] - start)
        gate.set()
    return samples


async def cross_process(directory: Path, n: int) -> list[float]:
    """Seconds from a `tether recall` in another process committing its intent (its journaled
    acceptance time) to the owning supervisor starting to drain: the wake-up's latency (the
    poll's, where none reaches it)."""
    gate, wait, waiter = blocked()

    url = f"sqlite:///{directory / f'xp-{time.monotonic_ns()}.db'}"
    samples: list[float] = []
    async with tether.Supervisor(url) as sup:
        drained: dict[str, float] = {}
        seen = asyncio.Event()

        def on_event(event: str, delegation_id: str) -> None:
            if event == "drain":
                drained[delegation_id] = time.time()
                seen.set()

        sup.listen(on_event)
        for _ in range(n):
            handle = await sup.delegate(waiter, tools=[wait])
            seen.clear()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tether", "recall", handle.id, "--grace", "5",
                "--no-wait", "--journal", url, stdout=subprocess.DEVNULL)
            await proc.wait()
            await seen.wait()
            (control,) = await sup.journal.controls(handle.id)
            samples.append(drained[handle.id] - control.accepted_at)
        gate.set()
    return samples


async def pg_worker_recall(n: int) -> list[float]:
    """Seconds from an orchestrator's recall committing (its journaled acceptance time) to the
    worker process holding the delegation acknowledging it (the ack's recorded time): the
    LISTEN/NOTIFY path, with polling as the fallback. One host, so the clocks agree."""
    import psycopg

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_agents import thinker

    schema = f"bench_{os.getpid()}"
    keys = tempfile.mkdtemp(dir=RESULTS)
    url = f"{PG}?schema={schema}&keys={keys}"
    samples: list[float] = []
    try:
        async with tether.Supervisor(url, recover=False) as sup:
            worker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tether", "worker", "--journal", url, "--agents",
                "bench_agents:AGENTS", cwd=Path(__file__).parent, stdout=subprocess.PIPE)
            assert worker.stdout is not None
            await worker.stdout.readline()  # ready
            for _ in range(n):
                handle = await sup.delegate(thinker, remote=True)
                while (entry := await sup.journal.queue_entry(handle.id)) is None \
                        or entry.claimed_by is None:
                    await sup.wake(0.005)  # until the worker claimed it
                await handle.recall(grace=5)
                (control,) = await sup.journal.controls(handle.id)
                ack = next(d for d in await sup.journal.documents(handle.id)
                           if d.type == tether.protocol.Acknowledgement.TYPE)
                samples.append(ack.recorded_at - control.accepted_at)
            worker.terminate()
            await worker.wait()
    finally:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        shutil.rmtree(keys, ignore_errors=True)
    return samples


async def storm(directory: Path, n: int, grace: float) -> tuple[float, float]:
    """``n`` live children, each with an action in flight, recalled at once. Returns (seconds
    until every fence was closed, seconds until every report was complete)."""
    release, slow, busy = in_flight()

    async with tether.Supervisor(journal_url(directory, f"storm-{time.monotonic_ns()}.db"),
                                 keys=tether.KeyRing.ephemeral(),
                                 policy=tether.Policy(max_grace=grace * 2)) as sup:
        fenced: list[float] = []
        sup.listen(lambda event, _: fenced.append(time.perf_counter())
                   if event == "drain" else None)
        handles = await asyncio.gather(*(sup.delegate(busy, tools=[slow]) for _ in range(n)))
        await sup.journal.flush()
        start = time.perf_counter()
        recalls = asyncio.gather(*(h.recall(grace=grace) for h in handles))
        loop = asyncio.get_running_loop()
        loop.call_later(grace / 2, release.set)  # in-flight actions finish within grace
        reports = await recalls
        done = time.perf_counter() - start
        assert all(r.outcome is tether.DelegationState.RECALLED for r in reports)
    return max(fenced) - start, done


async def shell_storm(directory: Path, n: int, grace: float) -> tuple[float, float]:
    """``n`` live children of one agent, each with an action in flight, recalled by one
    `tether recall --agent` in another process. Returns (seconds from the command's start
    until the owner was draining every one, seconds until the command ended with every
    report). The command's own start (about half a second of imports) is included."""
    release, slow, busy = in_flight()

    url = journal_url(directory, f"shell-storm-{time.monotonic_ns()}.db")
    async with tether.Supervisor(url, policy=tether.Policy(max_grace=grace * 2)) as sup:
        fenced: list[float] = []
        sup.listen(lambda event, _: fenced.append(time.perf_counter())
                   if event == "drain" else None)
        agent = tether.Agent("storm", busy, (slow,))
        await asyncio.gather(*(sup.delegate(agent, tools=[slow]) for _ in range(n)))
        await sup.journal.flush()
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", "recall", "--agent", "storm", "--grace", str(grace),
            "--json", "--journal", url, stdout=subprocess.PIPE)
        asyncio.get_running_loop().call_later(grace / 2, release.set)
        out, _ = await proc.communicate()
        done = time.perf_counter() - start
        answers = json.loads(out)["answers"]
        assert proc.returncode == 0 and len(answers) == n, (proc.returncode, len(answers))
    return max(fenced) - start, done


async def recall_under_load(directory: Path, children: int, actions: int,
                            samples: int) -> list[float]:
    """Seconds from recall() to the fence durably closed (the 'drain' event), for idle
    children recalled one after another while ``children`` others make ``actions`` EXTERNAL
    calls each, all at once: the journal's writer has a backlog of thousands of writes."""
    gate, wait, waiter = blocked()

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def noop(*, idempotency_key: str) -> None:
        return None

    async def busy(ctx: tether.Context) -> None:
        for _ in range(actions):
            await ctx.call(noop)

    out: list[float] = []
    async with tether.Supervisor(journal_url(directory, f"ul-{time.monotonic_ns()}.db"),
                                 keys=tether.KeyRing.ephemeral()) as sup:
        fenced = fence_times(sup)
        idle = [await sup.delegate(waiter, tools=[wait]) for _ in range(samples)]
        load = asyncio.gather(*(sup.delegate(busy, tools=[noop]) for _ in range(children)))
        running = asyncio.ensure_future(load)
        for handle in idle:
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            await handle.recall(grace=5)
            out.append(fenced[handle.id] - start)
        gate.set()
        await asyncio.gather(*(h.wait() for h in await running))
    return sorted(out)


async def idle_memory(n: int) -> float:
    """Bytes of Python memory per idle child (tracemalloc), with the journal on disk."""
    hold = asyncio.Event()

    async def idle(ctx: tether.Context) -> None:
        await hold.wait()

    with tempfile.TemporaryDirectory() as tmp:
        async with tether.Supervisor(f"sqlite:///{tmp}/idle.db",
                                     keys=tether.KeyRing.ephemeral()) as sup:
            await asyncio.gather(*(sup.delegate(idle) for _ in range(100)))  # warm caches
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            await asyncio.gather(*(sup.delegate(idle) for _ in range(n)))
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
            hold.set()
    return grown / n


def dbos_anchor(directory: Path, steps: int, workflows: int, wf_steps: int) -> dict[str, Any]:
    try:
        out = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "dbos_bench.py"), str(directory), str(steps),
             str(workflows), str(wf_steps)],
            capture_output=True, text=True, check=True, timeout=1800)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return {"error": f"DBOS anchor failed: {getattr(exc, 'stderr', '')[-400:]}"}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def sim_throughput(trials: int) -> float:
    """Trials per minute of `tether sim` (the production runtime, every fault, one process)."""
    from tether._sim.runs import run_sim

    start = time.perf_counter()
    run_sim(trials, 20_261)
    return trials / (time.perf_counter() - start) * 60


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    return {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(), "cpus": os.cpu_count(), "tether": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def target(name: str, value: float | None, goal: float, unit: str, kind: str,
           note: str = "") -> dict[str, Any]:
    met = value is not None and (value <= goal if kind == "max" else value >= goal)
    return {"name": name, "value": value, "target": goal, "unit": unit,
            "direction": "at most" if kind == "max" else "at least", "met": met, "note": note}


def mcp_proxy_figures(directory: Path, n: int) -> dict[str, Any] | None:
    """``tether mcp-proxy`` against a direct call (bench/mcp_overhead.py); None without mcp."""
    try:
        from mcp_overhead import proxy_overhead
    except ModuleNotFoundError:
        return None
    return asyncio.run(proxy_overhead(directory, n))


def temporal_figures(rounds: int, steps: int) -> dict[str, Any] | None:
    """A Temporal activity with tether and without (bench/temporal_activity.py), on a dev
    server it starts; None without the Temporal SDK or CLI (``pip install -e '.[temporal]'``)."""
    try:
        import temporal_activity
    except ModuleNotFoundError:
        return None
    if not (Path(sys.executable).parent / "temporal").exists():
        return None
    with tempfile.TemporaryDirectory() as tmp, temporal_activity.dev_server() as address:
        return asyncio.run(temporal_activity.main(
            address, f"sqlite:///{Path(tmp) / 'journal.db'}", rounds, steps))


def mcp_target(proxied: dict[str, Any] | None, commit: float) -> dict[str, Any]:
    """The proxy's own cost of a journaled call beyond one durable commit, p50 (goal: 1 ms)."""
    if proxied is None:
        return target("MCP proxy: journaled call over a direct one, minus one commit (p50)",
                      None, 1.0, "ms", "max", "mcp not installed: pip install -e '.[mcp]'")
    direct, journaled = proxied["direct"]["p50"], proxied["journaled"]["p50"]
    return target(
        "MCP proxy: journaled call over a direct one, minus one commit (p50)",
        (journaled - direct - commit) * 1000, 1.0, "ms", "max",
        f"{proxied['direct']['n']} echo calls: direct {direct * 1000:.2f} ms, journaled "
        f"{journaled * 1000:.2f} ms (p95 {proxied['journaled']['p95'] * 1000:.2f}), read-only "
        f"{proxied['read_only']['p50'] * 1000:.2f} ms"
        + (f"; proxy CPU per journaled call {proxied['journaled']['proxy_cpu'] * 1000:.2f} ms"
           if "proxy_cpu" in proxied["journaled"] else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, under a minute")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args()
    q = args.quick
    reps = 3 if q else 5
    RESULTS.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=RESULTS) as tmp:
        d = Path(tmp)
        # Interleaved pairs: the disk's speed drifts within a run, so each tether figure is
        # compared with a commit measured right before it.
        commit, seq, pair_ratio = [], [], []
        for _ in range(reps):
            commit.append(commit_cost(d, 200 if q else 500))
            seq.append(asyncio.run(sequential(d, 200 if q else 1000)))
            pair_ratio.append(seq[-1] / commit[-1])
        row100 = [commit_cost(d, 20 if q else 50, rows=100) / 100 for _ in range(reps)]
        pg_pairs: list[float] = []
        if pg_commit_cost(5) is not None:
            for _ in range(reps):
                base = pg_commit_cost(200 if q else 500)
                assert base is not None
                pg_pairs.append(asyncio.run(pg_sequential(200 if q else 1000)) / base)
        conc = [asyncio.run(concurrent(d, 1000, 20)) for _ in range(1 if q else 3)]
        cpu = [asyncio.run(concurrent(d, 1000, 20, sync="off"))[1] for _ in range(1 if q else 3)]
        lat = asyncio.run(recall_latency(d, 100 if q else 500))
        xproc = sorted(asyncio.run(cross_process(d, 10 if q else 40)))
        pg_recall = sorted(asyncio.run(pg_worker_recall(20 if q else 100))) \
            if pg_commit_cost(5) is not None else []
        storm_n = 1000 if q else 10_000
        storms = [asyncio.run(storm(d, storm_n, grace=2.0))]
        shell = asyncio.run(shell_storm(d, 500 if q else 2000, grace=2.0))
        loaded = asyncio.run(recall_under_load(d, 2000 if q else 4000, 5, 10 if q else 20))
        memory = asyncio.run(idle_memory(2000 if q else 10_000))
        dbos = dbos_anchor(d, 200 if q else 1000, 50 if q else 1000, 20)
        sims = [sim_throughput(100 if q else 500) for _ in range(1 if q else 3)]
        proxied = mcp_proxy_figures(d, 50 if q else 200)
        operator = operator_figures(d, 20_000 if q else 100_000)
        on_temporal = temporal_figures(2 if q else 5, 20 if q else 40)
    figures["commit_s"] = stats(commit)
    figures["row_in_100_commit_s"] = stats(row100)
    figures["tether_action_s"] = stats(seq)
    if pg_pairs:
        figures["pg_action_per_insert_ratio"] = stats(pg_pairs)
    figures["action_per_commit_ratio"] = stats(pair_ratio)
    figures["tether_concurrent_actions_per_s"] = stats([c[0] for c in conc])
    figures["tether_cpu_per_action_s"] = stats(cpu)
    lat.sort()
    figures["recall_fence_s"] = {"p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99) - 1],
                                 "max": lat[-1], "n": len(lat)}
    figures["cross_process_recall_s"] = {"p50": xproc[len(xproc) // 2], "max": xproc[-1],
                                         "n": len(xproc)}
    if pg_recall:
        figures["pg_worker_recall_s"] = {
            "p50": pg_recall[len(pg_recall) // 2],
            "p99": pg_recall[max(0, int(len(pg_recall) * 0.99) - 1)],
            "max": pg_recall[-1], "n": len(pg_recall)}
    figures["storm"] = {"children": storm_n, "grace_s": 2.0, "all_fenced_s": storms[0][0],
                        "all_reports_s": storms[0][1]}
    figures["shell_storm"] = {"children": 500 if q else 2000, "grace_s": 2.0,
                              "all_fenced_s": shell[0], "all_reports_s": shell[1],
                              "note": "one `tether recall --agent` in another process, its "
                                      "start included"}
    figures["recall_under_load_s"] = {
        "p50": loaded[len(loaded) // 2], "max": loaded[-1], "n": len(loaded),
        "note": f"idle children recalled while {2000 if q else 4000} others make 5 calls each"}
    figures["idle_child_bytes"] = memory
    figures["dbos"] = dbos
    figures["sim_trials_per_minute"] = stats(sims)
    if proxied is not None:
        figures["mcp_proxy_call_s"] = proxied
    figures["operator"] = operator
    if on_temporal is not None:
        figures["temporal_activity"] = on_temporal
    c_med = figures["commit_s"]["median"]
    per_action = figures["tether_action_s"]["median"]
    conc_rate = figures["tether_concurrent_actions_per_s"]["median"]
    dbos_sync = dbos.get("sync_steps_per_s")
    dbos_conc = dbos.get("concurrent_steps_per_s")
    targets = [
        target("per action vs one durable commit",
               figures["action_per_commit_ratio"]["median"], 1.5, "x", "max",
               "median of interleaved pairs"),
        target("sync actions/s vs DBOS sync steps/s",
               (1 / per_action) / dbos_sync if dbos_sync else None, 3.0, "x", "min",
               "" if dbos_sync else "DBOS anchor not run: pip install -r bench/requirements.txt"),
        target("1,000 children x 20 actions, durable", conc_rate, 30_000, "actions/s", "min"),
        target("concurrent actions/s vs DBOS concurrent workflows",
               conc_rate / dbos_conc if dbos_conc else None, 20.0, "x", "min",
               f"DBOS ran {50 if q else 1000} workflows x 20 steps"),
        target("CPU per journaled action (synchronous=OFF)",
               figures["tether_cpu_per_action_s"]["median"] * 1e6, 40.0, "us", "max"),
        target("recall to fence closed, p99 vs one durable commit",
               figures["recall_fence_s"]["p99"] / c_med, 3.0, "x", "max"),
        target("recall from another process acted on (max)",
               figures["cross_process_recall_s"]["max"] * 1000, 20.0, "ms", "max",
               f"`tether recall` in a second process, {len(xproc)} samples"),
        target(f"storm of {storm_n} children: all fenced", storms[0][0], 1.0, "s", "max"),
        target(f"storm of {storm_n} children: all reports (grace 2 s + 1 s)", storms[0][1], 3.0,
               "s", "max"),
        target("idle child memory", memory / 1024, 20.0, "KiB", "max",
               f"measured over {2000 if q else 10_000} idle children"),
        target("PostgreSQL per action vs one autocommit INSERT",
               figures["pg_action_per_insert_ratio"]["median"] if pg_pairs else None, 1.5, "x",
               "max", "median of interleaved pairs" if pg_pairs else f"no server at {PG}"),
        target("PostgreSQL recall reaching a worker, p99",
               figures["pg_worker_recall_s"]["p99"] * 1000 if pg_recall else None, 20.0, "ms",
               "max", f"`tether worker` process, {len(pg_recall)} recalls" if pg_recall
               else f"no server at {PG}"),
        mcp_target(proxied, c_med),
        target("Temporal: an activity with tether over the same plain (median)",
               on_temporal["added_ms"] if on_temporal else None, 2.0, "ms", "max",
               f"{on_temporal['steps']} activities in a row, {on_temporal['rounds']} rounds: "
               f"plain {on_temporal['plain_ms']} ms, with tether {on_temporal['tether_ms']} ms; "
               f"CPU {on_temporal['plain_cpu_ms']} vs {on_temporal['tether_cpu_ms']} ms"
               if on_temporal else "temporalio or the temporal CLI missing: pip install -e "
               "'.[temporal]'"),
        target("sim_throughput: `tether sim` trials per minute",
               figures["sim_trials_per_minute"]["median"], 10_000, "trials/min", "min",
               "every fault, one process"),
        target(f"`tether ls` first page at {operator['delegations']:,} delegations",
               operator["ls_first_page_s"] * 1000, 100.0, "ms", "max",
               f"open, query, render; the whole process (interpreter start) takes "
               f"{operator['ls_process_s'] * 1000:.0f} ms; journal "
               f"{operator['journal_bytes_per_action']:.0f} bytes per action"),
        target("journal bytes per action, written by the runtime (chain included)",
               operator["journal_bytes_per_action_chained"], 500, "bytes", "max",
               "delegations of one EXTERNAL action, a thousand at a time; rows, events, chain "
               f"entries and sealed heads (rows alone: "
               f"{operator['journal_bytes_per_action']:.0f})"),
    ]
    result = {"machine": machine(), "quick": q, "figures": figures, "targets": targets}
    (RESULTS / "latest.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (RESULTS / "latest.md").write_text(table)
    print(table)
    return 1 if args.check and not all(t["met"] for t in targets) else 0


def markdown(result: dict[str, Any]) -> str:
    f, m = result["figures"], result["machine"]
    lines = [
        f"tether {m['tether']} on {m['platform']}, {m['cpus']} CPUs, Python {m['python']}, "
        f"SQLite {m['sqlite']}, {m['date']}{' (quick)' if result['quick'] else ''}", "",
        "| target | value | goal | met |", "| --- | --- | --- | --- |",
    ]
    for t in result["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3g} {t['unit']}"
        lines.append(f"| {t['name']} | {value} | {t['direction']} {t['target']:g} {t['unit']} | "
                     f"{'yes' if t['met'] else 'no'}{' - ' + t['note'] if t['note'] else ''} |")
    lines += ["", "| figure | median | min | max |", "| --- | --- | --- | --- |"]
    for key in ("commit_s", "row_in_100_commit_s", "tether_action_s", "action_per_commit_ratio",
                "pg_action_per_insert_ratio", "tether_concurrent_actions_per_s",
                "tether_cpu_per_action_s", "sim_trials_per_minute"):
        if key not in f:
            continue
        s = f[key]
        lines.append(f"| {key} | {s['median']:.6g} | {s['min']:.6g} | {s['max']:.6g} |")
    r = f["recall_fence_s"]
    lines.append(f"| recall_fence_s (n={r['n']}) | p50 {r['p50']:.6g} | p99 {r['p99']:.6g} | "
                 f"{r['max']:.6g} |")
    dbos = f["dbos"]
    if "error" not in dbos:
        lines.append(f"| DBOS {dbos['version']} sync steps/s | "
                     f"{dbos['sync_steps_per_s']:.4g} | | |")
        lines.append(f"| DBOS concurrent steps/s | {dbos['concurrent_steps_per_s']:.4g} | | |")
    if "operator" in f:
        o = f["operator"]
        lines.append(f"| journal bytes per action ({o['delegations']:,} delegations of one "
                     f"action) | {o['journal_bytes_per_action']:.0f} | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
