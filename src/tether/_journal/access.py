"""How operations reach the journal (``JournalAccess``): the URL parsed into a backend and its
runner, writes, reads, posted writes, flushes and the chain's sealer. The operations are
``Journal``'s (``journal.py``); the rules they enforce live in ``ops``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar
from urllib.parse import parse_qs, unquote, urlparse

from tether._core.errors import JournalError, UserError
from tether._core.headmark import HeadMark, HeadMemory
from tether._core.model import DEFAULT_CLOCK_TOLERANCE
from tether._core.registrymark import RegistryMemory
from tether._core.signing import SigningKey, TrustedKeys
from tether._journal import chainops
from tether._journal.runner import Runner
from tether._journal.sqlite import SqliteRunner

if TYPE_CHECKING:
    from tether._journal.postgres import PostgresRunner

T = TypeVar("T")
log = logging.getLogger("tether.journal")
DEFAULT_URL = "sqlite:///.tether/journal.db"
SQLITE_PARAMETERS = frozenset({"keys", "busy_timeout", "synchronous"})
MAX_BUSY_TIMEOUT = 86_400.0  # seconds: a day; SQLite takes milliseconds as a 32-bit int
CONFIRM_WITHIN = 1.0  # seconds a closing PostgreSQL reader waits for the log (three WAL delays)
CONFIRM_EVERY = 0.05
POSITIONS_KEPT = 4096  # read positions kept before those no longer pending are dropped
# Chain heads left for want of the key directory's lock are tried again after this many
# seconds, doubling up to the maximum; a warning once they waited the patience.
PERSIST_RETRY, PERSIST_RETRY_MAX, PERSIST_PATIENCE = 0.05, 1.0, 5.0


def sqlite_path(url: str) -> Path:
    """``sqlite:///relative/path`` or ``sqlite:////absolute/path``, as SQLAlchemy spells them."""
    parsed = urlparse(url)
    if parsed.scheme != "sqlite" or parsed.netloc or not parsed.path.startswith("/"):
        raise UserError(
            f"journal URL {url!r} is not understood: use sqlite:///relative/path.db, "
            "sqlite:////absolute/path.db or postgresql://user@host/db?schema=name"
        )
    path = unquote(parsed.path[1:])
    if "\x00" in path:
        raise UserError(f"journal URL {url!r} names a path with a NUL byte in it")
    if not path:
        raise UserError(f"journal URL {url!r} names no file")
    return Path(path)

def _bind(fn: Callable[..., T], args: tuple[Any, ...], kw: dict[str, Any]) -> Callable[[Any], T]:
    """Bind an operation's arguments after the connection the backend passes first."""
    return lambda db: fn(db, *args, **kw)

class JournalAccess:
    """How operations reach a journal: its URL and backend, the runner, writes, reads,
    posted writes and flushes, and the sealer of what this process writes. ``Journal`` adds
    the operations themselves."""

    def __init__(self, url: str = DEFAULT_URL, *, create: bool = True, durable: bool = True,
                 busy_timeout: float | None = None, runner: Runner | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        """``runner``: run the operations of this SQLite journal with it rather than with a
        writer thread on the file (a simulation's inline runner); ``wall``: the clock the
        chain's seals are stamped with."""
        self._deferred: asyncio.TimerHandle | None = None  # a persist tried again soon
        self.url = url
        self._wall = wall
        # Posted writes (receipts, events) commit without waiting for the disk when nobody in
        # their batch waits for a durable commit (``flush(durable=False)``'s terms): the MCP
        # proxy's, whose receipts are flushed that way before its client hears of them.
        self.relaxed_posts = False
        self._moving: dict[str, int] = {}  # state moves queued, by delegation (``moving``)
        # Added to every dispatch deadline judged in a transaction (a key's earlier use, a
        # person's decision, retention): the supervisor sets its policy's.
        self.clock_tolerance = DEFAULT_CLOCK_TOLERANCE
        try:
            query = parse_qs(urlparse(url).query, keep_blank_values=True)
        except ValueError as exc:  # e.g. an unclosed "[" in the host
            raise UserError(f"journal URL {url!r} is not understood: {exc}") from None
        for name, values in sorted(query.items()):  # a default or the first would hide it
            if len(values) > 1:
                raise UserError(f"parameter {name!r} is given twice in the journal URL {url!r}")
            if values == [""]:
                raise UserError(f"parameter {name!r} has no value in the journal URL {url!r}")
        keys = query.get("keys", [None])[0]
        if keys is not None and "\0" in keys:
            raise UserError(f"the key directory in the journal URL {url!r} holds a NUL byte")
        if url.startswith(("postgresql://", "postgres://")):
            try:
                from tether._journal.postgres import PostgresRunner
            except ImportError as exc:
                raise UserError(
                    f"a postgresql:// journal needs psycopg ({exc}): "
                    "pip install 'tether[postgres]'") from None

            runner = PostgresRunner(url, create=create)
            self._runner: Runner = runner
            self._chain(runner)
            self._pg: PostgresRunner | None = runner
            self.path = Path(".tether") / "postgresql"
            self.keys_dir = Path(keys) if keys else Path(".tether") / "keys"
            self._shown = runner.shown
            return
        unknown = sorted(set(query) - SQLITE_PARAMETERS)
        if unknown:
            raise UserError(f"unknown parameter {unknown[0]!r} in the journal URL {url!r}; "
                            f"a SQLite journal takes {', '.join(sorted(SQLITE_PARAMETERS))}")
        if busy_timeout is None:
            try:
                busy_timeout = float(query.get("busy_timeout", ["5"])[0])
            except ValueError:
                raise UserError(f"busy_timeout in {url!r} is not a number") from None
        if not 0 <= busy_timeout <= MAX_BUSY_TIMEOUT:  # NaN and infinity fail this too
            raise UserError(f"busy_timeout in {url!r} must be between 0 and "
                            f"{MAX_BUSY_TIMEOUT:g} seconds")
        sync = query.get("synchronous", ["full" if durable else "normal"])[0].upper()
        if sync not in ("FULL", "NORMAL", "OFF"):
            raise UserError(f"synchronous in {url!r} must be full, normal or off")
        self.path = sqlite_path(url.split("?", 1)[0])
        self.keys_dir = Path(keys) if keys else self.path.parent / "keys"
        self._shown = ""
        self._pg = None
        self._runner = runner or SqliteRunner(self.path, create=create, synchronous=sync,
                                              busy_timeout=busy_timeout)
        self._chain(self._runner)

    def _chain(self, runner: Runner) -> None:
        self._sealer = sealer = chainops.Sealer()
        self._reader_witness: HeadMemory | None = None  # the last read's (``chain_verdicts``)
        # PostgreSQL: for each head a read accepted, that head, the server session and the
        # log's insert position right after the read (``placed``).
        self._positions: dict[str, tuple[HeadMark, str, int]] = {}
        self._opened = 0  # a journal opened again reads on a new connection (``_connection``)
        # The key registries' memories a key change here advanced: saved at the latest on close.
        self._registry_memories: list[RegistryMemory] = []
        wall = self._wall
        runner.sealer = lambda db, dirty: chainops.seal(db, dirty, sealer, wall())

    @property
    def signer(self) -> SigningKey | None:
        """Whose key seals this process's writes (docs/security.md): the supervisor's, the
        worker's or the CLI's. None: the chain is kept, unsealed, and `tether verify` says
        so. Set with ``seal_with``."""
        return self._sealer.signer

    def seal_with(self, signer: SigningKey, pins: TrustedKeys) -> None:
        """Seal this process's writes with ``signer``; extend another process's chain only if
        its seal verifies against the registry as ``pins`` root it."""
        self._sealer.signer, self._sealer.pins = signer, pins

    @property
    def reconnect_within(self) -> float:
        """Seconds an operation may wait for a lost connection to come back (PostgreSQL)
        before it fails with a JournalError; 0 on SQLite, which has no connection to lose."""
        return self._runner.reconnect_within

    @reconnect_within.setter
    def reconnect_within(self, seconds: float) -> None:
        if self._pg is not None:
            self._runner.reconnect_within = seconds

    @property
    def location(self) -> str:
        return self._shown or str(self.path.resolve())

    async def open(self) -> Self:
        await self._runner.start()
        self._opened += 1
        self._positions.clear()
        return self

    async def close(self) -> None:
        try:
            try:
                await self._confirm_on_server()
            finally:
                await self._runner.stop()
        finally:
            self._confirm_reads()
            self._save_memories()

    def _pending(self, token: object) -> list[HeadMemory]:
        """The memories holding heads a read through ``token`` accepted, unconfirmed."""
        return [m for m in {id(m): m for m in (self._sealer.witness, self._reader_witness)
                            if m is not None}.values() if m.pending(token)]

    def placed(self, accepted: dict[str, HeadMark], place: tuple[str, int] | None) -> None:
        """PostgreSQL: the heads one read accepted, and where the server's log was inserted
        up to right after it in the same transaction (past the commit of everything it saw),
        on which server session (None: a standby, which cannot say)."""
        for delegation_id, mark in accepted.items():
            if place is None:
                self._positions.pop(delegation_id, None)
            else:
                self._positions[delegation_id] = (mark, *place)
        if len(self._positions) > POSITIONS_KEPT:  # a long-lived process: keep what is pending
            token = self._connection()
            pending: dict[str, HeadMark] = {}
            for memory in self._pending(token):
                pending.update(memory.pending(token))
            self._positions = {d: p for d, p in self._positions.items()
                               if pending.get(d) == p[0]}

    async def _confirm_on_server(self) -> None:
        """PostgreSQL, at close: a head this process only read is remembered once the
        server's log is on disk past where it was right after the read that accepted it, on
        the same server session (a crash in between, even one the server restarts from by
        itself, ends the session and may have lost it). Its WAL writer flushes a commit that
        did not wait within a few hundred milliseconds, so this waits that long at most."""
        token = self._connection()
        if self._pg is None:
            return
        wanted: dict[str, tuple[HeadMemory, HeadMark, str, int]] = {}
        for memory in self._pending(token):
            for delegation_id, mark in memory.pending(token).items():
                known = self._positions.get(delegation_id)
                if known is not None and known[0] == mark:  # placed by the read that took it
                    wanted[delegation_id] = (memory, mark, known[1], known[2])
        if not wanted:
            return
        flushed = -1
        try:
            async with asyncio.timeout(CONFIRM_WITHIN):
                while True:
                    place = await self._read(lambda db: db.log_position(flushed=True))
                    if place is None or self._connection() != token:
                        return
                    session, flushed = place
                    wanted = {d: w for d, w in wanted.items() if w[2] == session}
                    if all(w[3] <= flushed for w in wanted.values()):
                        break
                    await asyncio.sleep(CONFIRM_EVERY)
        except (TimeoutError, JournalError):
            pass  # what was flushed by then still counts
        for delegation_id, (memory, mark, _, lsn) in wanted.items():
            if lsn <= flushed:
                memory.confirm({delegation_id: mark})

    def _confirm_reads(self) -> None:
        """Heads a read accepted since the last durable flush are remembered once on disk
        (a reader's close: `tether verify`'s): where the backend can put them there without
        writing (SQLite syncs its log; PostgreSQL's was found flushed past them,
        ``_confirm_on_server``), they are; otherwise they are left unremembered, a weaker
        witness, never a false one (the log says so)."""
        token = self._connection()
        memories = self._pending(token)
        if not memories:
            return
        if self._pg is not None or not self._runner.sync_log():
            log.info("the chain heads this process only read are not remembered by its "
                     "configuration: nothing it committed after reading them waited for the "
                     "disk, and the journal's log was not found on disk past them")
            return
        for memory in memories:
            memory.confirm(memory.pending(token))

    def _save_memories(self) -> None:
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
        # Closing: whatever is left waits for the directory, or the configuration never holds
        # it (the one wait on another process at close: said first).
        witnesses = (self._sealer.witness, self._reader_witness)
        if chainops.persist(*witnesses, wait=False):
            log.warning("closing: waiting for the key directory's lock, held by another "
                        "process or thread, to remember this process's chain heads")
            chainops.persist(*witnesses)
        for memory in self._registry_memories:
            # A key change committed here whose mark could not be saved then (``_after``):
            # saved now, or the process ends saying its configuration does not hold it.
            try:
                memory.save_pending()
            except Exception as exc:
                raise JournalError(
                    "a key change this process made is committed, but its configuration "
                    f"could not record it in registry.json: {exc}; fix that, then run "
                    "'tether keys registry' to record it") from None

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _write(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await self._written(_bind(fn, args, kw))

    async def _written(self, fn: Callable[[Any], T], urgent: bool = False) -> T:
        ran: list[Any] = []  # the batches it ran in: what the one that committed sealed
        fut = self._runner.submit(chainops.noting(fn, ran), write=True, urgent=urgent)
        assert fut is not None
        value = await fut
        self._sealer.committed(ran)
        return value

    async def _move(self, delegation_id: str, fn: Callable[..., T], *args: Any) -> T:
        """A state move of ``delegation_id``, counted in ``moving`` until it is answered."""
        with self.moves([delegation_id]):
            return await self._write(fn, delegation_id, *args)

    @contextlib.contextmanager
    def moves(self, delegation_ids: Iterable[str]) -> Iterator[None]:
        """While inside: these delegations' states are being moved here (``moving``)."""
        ids = list(delegation_ids)
        for d in ids:
            self._moving[d] = self._moving.get(d, 0) + 1
        try:
            yield
        finally:
            for d in ids:
                left = self._moving.pop(d) - 1
                if left:
                    self._moving[d] = left

    def moving(self, delegation_ids: Iterable[str]) -> bool:
        """Whether a state move of one of them (a child's end its code reached; a drain's
        settle of its tree, ``moves``) is queued here and not answered yet: a control intent
        then waits its turn behind it rather than skip it (``urgent``), or a finished child
        would be reported stopped."""
        return any(d in self._moving for d in delegation_ids)

    def _connection(self) -> object:
        """Which connection the operation running now is on (read on the writer's thread,
        inside the operation): this runner's, as many times opened and reconnected."""
        return (self._runner, self._opened, self._runner.reconnects)

    def _persist(self) -> None:
        """A moment that matters (docs/security.md, "Rollback"): the configuration's key
        directory learns the heads remembered since the last one. The event loop never waits
        for another process: if one holds the directory's lock (most often for its own
        append, a moment), the heads are tried again shortly, never waited for."""
        if self._deferred is not None:
            return  # a retry is due: it takes these heads too
        if chainops.persist(self._sealer.witness, self._reader_witness, wait=False):
            self._defer(PERSIST_RETRY, asyncio.get_running_loop().time())

    def _defer(self, delay: float, since: float, said: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._deferred = loop.call_later(delay, self._retry, delay, since, said)

    def _retry(self, delay: float, since: float, said: bool) -> None:
        self._deferred = None
        if not chainops.persist(self._sealer.witness, self._reader_witness, wait=False):
            return
        waited = asyncio.get_running_loop().time() - since
        if not said and waited >= PERSIST_PATIENCE:  # said once, however late this try ran
            log.warning("chain heads not yet remembered in the key directory after %.1fs: "
                        "another process or thread holds its lock; still trying", waited)
            said = True
        self._defer(min(delay * 2, PERSIST_RETRY_MAX), since, said)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        fut = self._runner.submit(_bind(fn, args, {}), write=False)
        assert fut is not None
        return await fut

    def _post(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """Queue a write without waiting for its commit: it rides the next batch."""
        self._runner.submit(_bind(fn, args, kw), write=True, wait=False,
                            relaxed=self.relaxed_posts)

    async def peek(self, fn: Callable[..., T], *args: Any) -> T:
        """A read of other processes' committed work. On PostgreSQL it runs on a pooled
        connection beside the writer, so polling never waits behind this process's batches."""
        if self._pg is None:
            return await self._read(fn, *args)
        return await self._pg.read_beside(_bind(fn, args, {}))

    def on_notify(self, callback: Callable[[str], None]) -> bool:
        """Have ``callback(owner_id)`` called (from any thread) when a control intent for one
        of that owner's delegations commits. False where the backend cannot push (a SQLite
        journal whose wake-up directory is not this user's own, ``wake``): the caller then
        relies on polling alone."""
        return self._runner.listen(callback)

    async def flush(self, durable: bool = True) -> None:
        """Wait until everything queued before now is committed. ``durable=False``: committed
        so as to survive a crash of this process, not necessarily of the machine, until the
        next durable commit (SQLite ``synchronous=NORMAL``, PostgreSQL ``synchronous_commit
        = off`` for that commit; the same when the journal is not durable anyway)."""
        ran: list[Any] = []
        sealer = self._sealer
        readers = (self._reader_witness,)
        fut = self._runner.submit(chainops.noting(
            lambda db: chainops.read_back(db, sealer, readers, self._connection()), ran),
            write=True, relaxed=not durable)
        assert fut is not None
        await fut
        sealer.committed(ran)
        self._persist()
