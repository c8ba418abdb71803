"""Wake-ups among the processes of one SQLite journal: what LISTEN/NOTIFY gives a PostgreSQL
journal, for a file on one host.

Each process that listens binds a Unix datagram socket in a directory named after the
journal's file, private to its user (under ``/run/user/UID`` where the system keeps one for
the user, else ``/tmp``: never a per-session variable, so that a recall run from cron, ssh or
sudo -u finds the same place); a write batch that notified sends each payload, once it
committed, to every socket there. A
datagram is a hint, never a fact: whoever gets one reads the journal, as its poll would, so a
lost, late, stale or forged one costs a read, never an action, and polling stays the fallback
(a directory that is not this user's own, a full socket buffer, another host).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

TICK = 0.25  # how often a listener's thread checks that it should stop
MAX_PAYLOAD = 256  # bytes: an owner id, "queued", "done"


BASE: Path | None = None  # where the directories go (None: ``_base``); tests set their own


def _base() -> Path:
    if BASE is not None:
        return BASE
    run = Path(f"/run/user/{os.getuid()}")
    with contextlib.suppress(OSError):
        if run.is_dir() and run.stat().st_uid == os.getuid():
            return run
    return Path("/tmp")


def directory(journal: Path) -> Path:
    """Where the listeners of ``journal`` (an absolute path) bind, for this user."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(journal))).hexdigest()[:16]
    return _base() / f"tether-wake-{os.getuid()}-{key}"


def _own(where: Path, make: bool) -> bool:
    """Whether ``where`` is a directory of this user's that nobody else may write to (made,
    mode 0700, if ``make``). Anything else is not used: polling does the work."""
    if make:
        with contextlib.suppress(FileExistsError, OSError):
            where.mkdir(mode=0o700)
    try:
        st = os.lstat(where)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


class Listener:
    """A bound socket and the thread that hands each datagram to ``callback`` (from that
    thread); ``close`` stops it and removes its socket."""

    def __init__(self, where: Path, callback: Callable[[str], None]) -> None:
        self.where = where
        self._callback = callback
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._pid = os.getpid()
        self._path = where / f"{self._pid}-{secrets.token_hex(4)}"
        try:
            for _ in range(3):  # the last listener out may remove the directory meanwhile
                try:
                    self._sock.bind(str(self._path))
                    break
                except FileNotFoundError:
                    if not _own(where, make=True):
                        raise
            else:
                raise FileNotFoundError(str(self._path))
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(TICK)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tether-wake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(MAX_PAYLOAD)
            except TimeoutError:
                continue
            except OSError:
                return  # closed under us
            if self._closed.is_set():
                return
            with contextlib.suppress(Exception):  # a listener's failure is a missed hint
                self._callback(data.decode("utf-8", "replace"))

    def close(self) -> None:
        """Stop at once: an empty datagram to itself ends the thread's wait (closing the
        socket does not), so that closing a journal never holds its event loop. In a process
        forked from the one that listens, only the inherited descriptor goes: the socket's
        path, its thread and the directory are its parent's."""
        if os.getpid() != self._pid:
            self._sock.close()
            return
        self._closed.set()
        with contextlib.suppress(OSError), \
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as poke:
            poke.sendto(b"", str(self._path))
        if self._thread is not threading.current_thread():
            self._thread.join(TICK * 4)
        with contextlib.suppress(OSError):
            self._path.unlink()
        self._sock.close()
        with contextlib.suppress(OSError):  # the last one out: an empty directory goes
            self.where.rmdir()


def listen(journal: Path, callback: Callable[[str], None]) -> Listener | None:
    """Listen for ``journal``'s notifications; None where this user cannot (then poll)."""
    where = directory(journal)
    if not _own(where, make=True):
        return None
    try:
        return Listener(where, callback)
    except OSError:  # a path too long for a socket, a full disk: polling does the work
        with contextlib.suppress(OSError):
            where.rmdir()
        return None


def send(journal: Path, payloads: Iterable[str]) -> None:
    """Tell every listener of ``journal`` of each payload, without ever waiting: a socket whose
    process is gone is removed, a full one misses the hint."""
    where = directory(journal)
    try:
        names = os.listdir(where)
    except OSError:
        return
    if not names or not _own(where, make=False):
        return
    data = [p.encode("utf-8")[:MAX_PAYLOAD] for p in dict.fromkeys(payloads)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for name in names:
            target = str(where / name)
            for payload in data:
                try:
                    sock.sendto(payload, target)
                except ConnectionRefusedError:  # bound by a process that died
                    with contextlib.suppress(OSError):
                        os.unlink(target)
                    break
                except OSError:  # full, gone meanwhile, not a socket: a missed hint
                    break


__all__ = ["Listener", "directory", "listen", "send"]
