"""How long the MCP Inspector's CLI (npm) takes to list a server's tools, run directly and
through ``tether mcp-proxy`` over stdio: the whole run as a user waits for it (the Inspector
starts the server, or the proxy, lists, closes stdin and waits for it to exit), alternated
run by run so that a machine's drift touches both alike. The goal (issue 25): through the
proxy within 1 s of direct.

    python bench/mcp_inspector.py [--runs 9] [--server filesystem|everything]

Needs the npm packages of ``.ci/node`` (``scripts/test`` installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".ci" / "node" / "node_modules" / ".bin"


def server(name: str, folder: Path) -> list[str]:
    if name == "filesystem":
        return [str(BIN / "mcp-server-filesystem"), str(folder)]
    return [str(BIN / "mcp-server-everything")]


def once(argv: list[str]) -> float:
    start = time.monotonic()
    done = subprocess.run([str(BIN / "mcp-inspector"), "--cli", *argv, "--method", "tools/list"],
                          capture_output=True, timeout=120)
    took = time.monotonic() - start
    if done.returncode != 0 or "tools" not in json.loads(done.stdout):
        sys.exit(f"error: the Inspector failed: {done.stderr.decode()[-500:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--server", choices=("filesystem", "everything"), default="filesystem")
    args = parser.parse_args()
    if not (BIN / "mcp-inspector").exists():
        sys.exit("error: run scripts/test once first (it installs the npm packages)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        upstream = " ".join(server(args.server, folder))
        # The Inspector gives a server only a safe default environment: PYTHONPATH (a
        # checkout's src, to time one commit against another) is passed on by name.
        env = ["-e", f"PYTHONPATH={os.environ['PYTHONPATH']}"] \
            if os.environ.get("PYTHONPATH") else []
        proxy = [*env, sys.executable, "-m", "tether", "mcp-proxy", "--journal",
                 f"sqlite:///{folder / 'journal.db'}", "--upstream", f"up={upstream}"]
        once(server(args.server, folder))  # warm: npm's and Python's caches
        once(proxy)
        direct: list[float] = []
        through: list[float] = []
        for _ in range(args.runs):
            direct.append(once(server(args.server, folder)))
            through.append(once(proxy))
    d, p = statistics.median(direct), statistics.median(through)
    print(json.dumps({"server": args.server, "runs": args.runs, "direct_s": round(d, 3),
                      "proxy_s": round(p, 3), "added_s": round(p - d, 3),
                      "goal_added_s": 1.0}))


if __name__ == "__main__":
    main()
