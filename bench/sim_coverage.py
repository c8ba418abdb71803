"""How much of the runtime and journal that a real SQLite run executes ``tether sim`` runs:
the lines of each module executed by ``tether chaos`` on SQLite (real processes, a real
journal file), and the share of them that simulated trials execute too (issue 23's goal: at
least 70%).

    pip install -r bench/requirements.txt
    python bench/sim_coverage.py [--trials 300] [--seed 2026120606] [--chaos 20]

Coverage is started after ``asyncio`` is imported, in this process and in every process the
chaos run starts (a ``sitecustomize`` on ``PYTHONPATH``): tracing the import of ``asyncio``
(as ``coverage run`` does) gave it two ``CancelledError`` classes here, and timeouts then let
a cancellation through instead of a ``TimeoutError``. A process chaos kills with SIGKILL
saves nothing; its lines count only if another process ran them.
"""

from __future__ import annotations

import argparse
import asyncio  # noqa: F401  (imported before tracing starts: see above)
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import coverage

SOURCE = ["tether._runtime", "tether._journal"]
MODULES = ["_runtime/supervisor.py", "_runtime/gateway.py", "_runtime/draining.py",
           "_runtime/accounting.py", "_runtime/reconcile.py", "_runtime/remote.py",
           "_runtime/worker.py", "_runtime/attempts.py", "_runtime/adoption.py",
           "_journal/ops.py", "_journal/actions.py", "_journal/chainops.py",
           "_journal/runner.py", "_journal/journal.py", "_journal/tables.py"]
SITE = f"""
import os
if os.environ.get("TETHER_COV"):
    import asyncio
    import atexit, signal, coverage
    cov = coverage.Coverage(source={SOURCE!r}, data_file=os.environ["TETHER_COV"],
                            data_suffix=True)
    cov.start()
    def save(*_):
        cov.stop()
        cov.save()
    def terminated(signum, frame):
        save()
        os._exit(128 + signum)
    atexit.register(save)
    signal.signal(signal.SIGTERM, terminated)
"""


def lines(data: Path) -> dict[str, set[int]]:
    found = coverage.CoverageData(basename=str(data))
    found.read()
    return {f.split("/tether/", 1)[-1]: set(found.lines(f) or ()) for f in found.measured_files()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--seed", type=int, default=2026120606)
    parser.add_argument("--chaos", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITE)
        real = work / "real"
        env = {**os.environ, "TETHER_COV": str(real),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "site"),
                                                           os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-m", "tether", "chaos", "--trials", str(args.chaos),
                        "--seed", str(args.seed), "--json"], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
        combined = coverage.Coverage(data_file=str(real))
        combined.combine([str(p) for p in work.glob("real.*")])
        combined.save()
        sim = work / "sim"
        cov = coverage.Coverage(source=SOURCE, data_file=str(sim))
        cov.start()
        from tether._sim.runs import run_sim

        judged = run_sim(args.trials, args.seed)
        cov.stop()
        cov.save()
        ran, simulated = lines(real), lines(sim)
    total = shared = 0
    print(f"{'module':28} {'real':>5} {'both':>5}  share")
    for name in MODULES:
        r, s = ran.get(name, set()), simulated.get(name, set())
        total, shared = total + len(r), shared + len(r & s)
        print(f"{name:28} {len(r):5} {len(r & s):5}  {100 * len(r & s) / max(1, len(r)):5.1f}%")
    print(f"{'these modules':28} {total:5} {shared:5}  {100 * shared / max(1, total):5.1f}%")
    every = {(f, n) for f, ns in ran.items() for n in ns}
    both = every & {(f, n) for f, ns in simulated.items() for n in ns}
    print(f"{'all of _runtime, _journal':28} {len(every):5} {len(both):5}  "
          f"{100 * len(both) / max(1, len(every)):5.1f}%")
    print(f"(the simulated trials judged: {judged['counts']})")
    return 0 if total and shared / total >= 0.7 else 1


if __name__ == "__main__":
    sys.exit(main())
