"""A private PostgreSQL server in a temporary directory, on a port of its own, for the tests and
chaos trials that restart it, terminate its backends or pause it (never the server others use).

The binaries are the host's (``pg_config --bindir``, else the newest of
``/usr/lib/postgresql/*/bin``). initdb refuses to run as root: as root, the server runs as the
``postgres`` OS user, in a directory given to it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from tether._core.errors import UserError

START_WAIT = 60  # seconds pg_ctl may take to start or restart the server


def bindir() -> Path:
    """Where initdb and pg_ctl are; a UserError naming what to install if nowhere."""
    found = shutil.which("pg_config")
    if found:
        out = subprocess.run([found, "--bindir"], capture_output=True, text=True, check=False)
        path = Path(out.stdout.strip())
        if (path / "initdb").exists():
            return path
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                      else 0)
    if versions:
        return versions[-1].parent
    raise UserError("no PostgreSQL server binaries (initdb, pg_ctl) found: install the "
                    "postgresql package")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PrivateServer:
    """``with PrivateServer() as pg: pg.url ...; pg.restart("immediate")``.

    ``fsync`` is the server's default (on): a restart then writes its checkpoint, or replays
    its log, to disk, as a production server does; ``fsync=False`` is for speed only."""

    def __init__(self, *, fsync: bool = True, wal_writer_delay: str | None = None) -> None:
        self.fsync = fsync
        # How long a commit that did not wait for the disk (``synchronous_commit = off``) may
        # stay in the server's memory, lost by a crash (None: the server's 200 ms).
        self.wal_writer_delay = wal_writer_delay
        self.bin = bindir()
        self.root = Path(tempfile.mkdtemp(prefix="tether-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.paused = False

    def _run(self, *argv: str, timeout: float = START_WAIT) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_root else []
        done = subprocess.run([*prefix, *argv], capture_output=True, text=True,
                              timeout=timeout, check=False)
        if done.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr.strip()} "
                               f"{done.stdout.strip()[-500:]} {tail}")

    def start(self) -> PrivateServer:
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "--auth=trust", "-E", "UTF8", "--no-sync")
        self.up()
        return self

    def up(self) -> None:
        """Start the server (after ``start`` created it, or after ``down``)."""
        # Sockets in its own directory; fsync as asked (the default: the server's own, on).
        options = (f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 "
                   f"-c max_connections=200{'' if self.fsync else ' -c fsync=off'}"
                   + (f" -c wal_writer_delay={self.wal_writer_delay}"
                      if self.wal_writer_delay else ""))
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                  "-o", options, "-w", "-t", str(START_WAIT), "start")

    def down(self, mode: str = "fast") -> None:
        """Stop the server, keeping its data, until ``up``."""
        self.resume()
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        """``fast``: sessions are ended cleanly; ``immediate``: the server crashes and recovers."""
        self.resume()
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                  "-m", mode, "-w", "-t", str(START_WAIT), "restart")

    def stop(self) -> None:
        self.resume()
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                      "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def terminate(self, application_name: str | None = None) -> int:
        """End every client backend (only those of ``application_name`` if given), as
        ``pg_terminate_backend`` does after a failover or an operator's kill; how many."""
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            return terminate(conn, application_name)

    def pids(self) -> list[int]:
        """The postmaster and every process it started."""
        head = (self.data / "postmaster.pid").read_text().split()[0]
        postmaster = int(head)
        found = [postmaster]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == postmaster:
                    found.append(int(stat.parent.name))
        return found

    def pause(self) -> None:
        """Stop the server and its backends (SIGSTOP): connections hang, none breaks."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if not self.paused:
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused = False

    def wait_ready(self, within: float = START_WAIT) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> PrivateServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def terminate(conn: psycopg.Connection[Any], application_name: str | None = None) -> int:
    """``pg_terminate_backend`` on the client backends of the connection's database, other
    than its own (only those of ``application_name`` if given)."""
    query = ("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
             "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' "
             "AND datname = current_database()")
    params: tuple[str, ...] = ()
    if application_name is not None:
        query += " AND application_name = %s"
        params = (application_name,)
    row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0
