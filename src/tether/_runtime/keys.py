"""Key files: this process's signing key and the root keys its configuration pins.

Layout of a key directory (default: ``keys/`` beside the journal file), mode 0700:
``signing.json`` holds the private key and ``trusted.json`` maps the ids of the pinned root
keys to their public keys, both mode 0600 whatever the umask; ``registry.json`` and
``heads.jsonl`` are what the configuration remembers of journals (their key registries, their
delegations' chain heads). Files are written to a temporary file and renamed into place;
creation is serialised by an advisory lock on ``.lock``, so several processes starting on one
fresh journal end up sharing one key.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tether._core.errors import ControlRefused, UserError
from tether._core.headmark import Busy, HeadMark, HeadMemory, merge_marks
from tether._core.registrymark import RegistryMark, RegistryMemory
from tether._core.signing import SigningKey, TrustedKeys

# Seconds a wait for the key directory's lock lasts (``_locked``), and once a wait for it gave
# up, until a save lands (a registry mark's).
LOCK_PATIENCE, IMPATIENT = 30.0, 0.1


def _fail(action: str, path: Path, exc: OSError) -> UserError:
    return UserError(f"cannot {action} {path}: {exc.strerror or exc}")


def private_dir(directory: Path) -> None:
    """Create the key directory (and parents) with mode 0700, whatever the umask."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _owned(directory)
        os.chmod(directory, 0o700)
    except FileExistsError as exc:
        raise _fail("use as a key directory", directory, exc) from None
    except OSError as exc:
        raise _fail("create the key directory", directory, exc) from None


def _owned(directory: Path) -> None:
    """Keys live only in a directory this user owns: one that another user created first (in
    a shared working directory, say) would let them replace the pinned roots, even at 0700."""
    owner = directory.stat().st_uid
    if owner != os.geteuid():
        raise UserError(f"key directory {directory} belongs to user {owner}, not to this "
                        f"user ({os.geteuid()}): refusing to keep or read keys there")


def write_private(path: Path, text: str, *, exclusive: bool = False) -> bool:
    """Write ``text`` to ``path`` atomically with mode 0600: a temporary file, then a rename
    (``os.replace``) or, when ``exclusive``, a hard link that fails if ``path`` exists.
    Returns False when ``exclusive`` and the file was there already."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise _fail("write to", path.parent, exc) from None
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    except OSError as exc:
        raise _fail("write", path, exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class LockTimeout(UserError):
    """The key directory stayed locked past ``LOCK_PATIENCE``: its holder is paused or hung."""


@contextlib.contextmanager
def _locked(directory: Path, *, wait: bool = True,
            patience: float | None = None) -> Iterator[None]:
    """An exclusive advisory lock on the key directory, held while keys are created. Not
    ``wait``: ``Busy`` at once if it is held (by another process, or through another open
    of the lock file in this one: another thread's). ``wait``: for at most ``patience``
    seconds (``LOCK_PATIENCE``), then ``LockTimeout``: a holder's own work takes
    milliseconds, so one that keeps it that long is paused or hung, and waiting for it would
    hang a close or the journal's writer with it."""
    try:
        # Never through a symbolic link: that would create or open a file elsewhere.
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise _fail("lock", directory, exc) from None
    mine = True  # the descriptor is closed here (not by a waiting thread given up on)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise Busy(f"{directory} is locked by another process or thread") from None
            waited = LOCK_PATIENCE if patience is None else patience
            mine = False  # ``_wait_for`` hands it back only with the lock taken
            mine = _wait_for(fd, directory, waited)
            if not mine:
                raise LockTimeout(f"{directory} stayed locked by another process or thread "
                                  f"for {waited:g} s (one paused or hung while it held the "
                                  "lock?)") from None
        yield
    finally:
        if mine:
            _let_go(fd)


def _let_go(fd: int) -> None:
    # Unlocked before it is closed: a child forked meanwhile shares the descriptor, and its
    # copy would keep the lock held until it exits.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _wait_for(fd: int, directory: Path, patience: float) -> bool:
    """Take the lock on ``fd`` within ``patience`` seconds: True with it taken (``fd`` is the
    caller's to close), False otherwise (``fd`` is no longer the caller's). A blocking flock on
    a thread of its own, since the kernel wakes a blocked waiter as the lock is let go (a poll
    loses to holders that take it back at once) and a blocking call cannot be given up. Given
    up (or this wait interrupted), that thread owns ``fd`` and lets the lock go the moment it
    gets it."""
    got, guard = threading.Event(), threading.Lock()
    state: dict[str, object] = {}

    def take() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            state["error"] = exc
        with guard:
            if state.get("gave_up"):
                _let_go(fd)
                return
            got.set()

    try:
        threading.Thread(target=take, name="tether-key-lock", daemon=True).start()
        got.wait(patience)
    except BaseException:  # interrupted: whoever has the descriptor last lets it go
        with guard:
            if got.is_set():
                _let_go(fd)
            else:
                state["gave_up"] = True
        raise
    with guard:
        if not got.is_set():
            state["gave_up"] = True
            return False
    error = state.get("error")
    if isinstance(error, OSError):
        os.close(fd)
        raise _fail("lock", directory, error)
    return True


def _tighten(directory: Path, *files: Path) -> None:
    """Key files written by an older tether followed the umask: make them private now (where
    this process owns them; otherwise leave them, the owner's tools will)."""
    for path, mode in ((directory, 0o700), *((f, 0o600) for f in files)):
        with contextlib.suppress(OSError):
            if path.stat().st_mode & 0o077:
                os.chmod(path, mode)


@dataclass
class KeyRing:
    signer: SigningKey
    trusted: TrustedKeys  # the root keys this process's configuration pins
    directory: Path | None = None

    def __post_init__(self) -> None:
        if self.directory is not None:
            # Absolute as of now: a process that changes directory later keeps reading and
            # writing this configuration's memory, not one under its new working directory.
            self.directory = Path(os.path.abspath(self.directory))
        if self.trusted.memory is None:
            self.trusted.memory = _memory(self.directory)
        if self.trusted.heads is None:
            self.trusted.heads = _heads(self.directory)

    @classmethod
    def ephemeral(cls) -> KeyRing:
        """A fresh key pinned only by this ring: for tests and one-process use."""
        signer = SigningKey.generate("ephemeral")
        return cls(signer, TrustedKeys([signer.public]))

    @classmethod
    def load(cls, directory: Path) -> KeyRing:
        signing, trusted = directory / "signing.json", directory / "trusted.json"
        if not signing.exists():
            raise UserError(f"no signing key in {directory}; run 'tether keys init'")
        _owned(directory)
        try:
            data = json.loads(signing.read_text())
            signer = SigningKey.from_raw(bytes.fromhex(data["private"]), data.get("label", ""))
            if signer.key_id != data["key_id"]:
                raise ValueError("key id does not match the key")
            keys = TrustedKeys.from_b64(json.loads(trusted.read_text()))
        except (OSError, ValueError, KeyError, TypeError, ControlRefused) as exc:
            raise UserError(f"key files in {directory} are unreadable: {exc}") from None
        _tighten(directory, signing, trusted)
        return cls(signer, keys, directory)

    @classmethod
    def init(cls, directory: Path, label: str = "operator",
             pins: dict[str, str] | None = None) -> KeyRing:
        """Create a signing key. The configuration pins ``pins`` (``{key_id: public}``) as
        root keys, or, by default, the new key itself. Refuses to replace an existing key."""
        private_dir(directory)
        with _locked(directory):
            return cls._create(directory, label, pins, replace=False)

    @classmethod
    def _create(cls, directory: Path, label: str, pins: dict[str, str] | None, *,
                replace: bool) -> KeyRing:
        signing, trusted = directory / "signing.json", directory / "trusted.json"
        if signing.exists():
            if replace:
                return cls.load(directory)
            raise UserError(f"{signing} already exists; refusing to replace a signing key")
        signer = SigningKey.generate(label)
        pinned: dict[str, str] = {}
        if trusted.exists():
            try:
                pinned = dict(json.loads(trusted.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                raise UserError(f"{trusted} is unreadable: {exc}") from None
        pinned.update(pins if pins is not None else {signer.key_id: signer.public_b64()})
        ring = cls(signer, TrustedKeys.from_b64(pinned), directory)
        # trusted.json first: whoever sees signing.json finds its pins beside it.
        write_private(trusted, json.dumps(pinned, indent=2, sort_keys=True))
        body = json.dumps({"key_id": signer.key_id, "label": label,
                           "private": signer.raw().hex()})
        if not write_private(signing, body, exclusive=True):
            raise UserError(f"{signing} already exists; refusing to replace a signing key")
        return ring

    @classmethod
    def load_or_init(cls, directory: Path) -> KeyRing:
        if (directory / "signing.json").exists():
            return cls.load(directory)
        private_dir(directory)
        with _locked(directory):
            return cls._create(directory, "operator", None, replace=True)

    def pin(self, key_id: str, public_b64: str) -> None:
        """Pin another root key in this configuration (``tether keys pin``)."""
        if self.directory is None:
            raise UserError("an ephemeral key ring has no configuration to pin keys in")
        trusted = self.directory / "trusted.json"
        with _locked(self.directory):
            pinned = dict(json.loads(trusted.read_text()))
            pinned[key_id] = public_b64
            memory, heads = self.trusted.memory, self.trusted.heads
            self.trusted = TrustedKeys.from_b64(pinned)
            self.trusted.memory, self.trusted.heads = memory, heads
            write_private(trusted, json.dumps(pinned, indent=2, sort_keys=True))


REGISTRY = "registry.json"  # what this configuration has seen of journals' key registries


def _memory(directory: Path | None) -> RegistryMemory:
    """The configuration's memory of key registries (``_core.registrymark``), read from and
    written to ``registry.json`` in its key directory (in memory only for an ephemeral ring)."""
    lock = threading.RLock()  # the writer thread and pooled readers decide at once
    if directory is None:
        return RegistryMemory(lock=lock)
    path = directory / REGISTRY

    looked: list[tuple[int, int, int] | None] = [None]  # the file as last read (stat)

    def stamp() -> tuple[int, int, int] | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def read() -> dict[str, RegistryMark]:
        seen = stamp()
        if seen is None:
            looked[0] = None
            return {}
        try:
            marks = {k: RegistryMark.from_json(v)
                     for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Not marked as read: every decision tries it again until it reads (fail closed).
            raise UserError(f"{path} is unreadable: {exc}") from None
        looked[0] = seen
        return marks

    def changed() -> dict[str, RegistryMark] | None:
        # One stat per trust decision; the file is read again only when it was rewritten.
        return None if stamp() == looked[0] else read()

    # A wait for the lock gave up: later saves (each decision tries again, on the journal's
    # writer thread) wait a moment, as for another process's append, never the whole patience
    # again, until one lands.
    impatient = [False]

    def save(marks: dict[str, RegistryMark]) -> None:
        try:
            with _locked(directory, patience=IMPATIENT if impatient[0] else None):
                merged = read()
                for anchor, mark in marks.items():
                    known = merged.get(anchor)
                    if known is None or known.length <= mark.length:
                        revoked = set(mark.revoked) | set(known.revoked if known else ())
                        merged[anchor] = RegistryMark(mark.length, mark.digest,
                                                      tuple(sorted(revoked)))
                write_private(path, json.dumps({k: v.to_json() for k, v in merged.items()},
                                               indent=2, sort_keys=True))
        except LockTimeout:
            impatient[0] = True
            raise
        impatient[0] = False

    return RegistryMemory(read(), save, changed, lock)


HEADS = "heads.jsonl"  # the latest chain head this configuration wrote or accepted, per delegation
_COMPACT = 64 * 1024  # bytes below which a heads file is never compacted


def _heads(directory: Path | None) -> HeadMemory:
    """The configuration's memory of chain heads (``_core.headmark``), in ``heads.jsonl`` in
    its key directory: one ``[delegation, length, hash]`` line per head persisted, appended
    under the directory's lock (no whole-file rewrite, no fsync per head), and compacted to one
    line per delegation once it holds about twice that. In memory only for an ephemeral ring."""
    lock = threading.Lock()  # the journal's writer thread and the event loop both note heads
    if directory is None:
        return HeadMemory(lock=lock)
    path = directory / HEADS
    looked = [0, 0]  # the file's inode, and the offset read up to

    def parse(data: bytes, into: dict[str, HeadMark]) -> dict[str, HeadMark]:
        def lines() -> Iterator[tuple[str, HeadMark]]:
            for line in data.splitlines():
                try:
                    yield HeadMark.from_json(json.loads(line))
                except ValueError:
                    continue  # a line torn by a crash in the middle of an append

        return merge_marks(into, lines())

    def load() -> dict[str, HeadMark] | None:
        """What was appended since the last look (all of it if the file was compacted, a
        new inode); one stat when nothing changed."""
        try:
            st = os.stat(path, follow_symlinks=False)
            if (st.st_ino, st.st_size) == tuple(looked):
                return None
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _fail("read", path, exc) from None
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            start = looked[1] if st.st_ino == looked[0] and st.st_size >= looked[1] else 0
            fh.seek(start)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a last line still being written is read next time
        looked[:] = [st.st_ino, start + end]
        return parse(data[:end], {})

    def save(marks: Mapping[str, HeadMark], known: int, wait: bool) -> None:
        text = "".join(json.dumps(m.to_json(d), separators=(",", ":")) + "\n"
                       for d, m in marks.items()).encode()
        with _locked(directory, wait=wait):
            try:
                fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                             0o600)
                try:
                    end = os.fstat(fd).st_size
                    if end and os.pread(fd, 1, end - 1) != b"\n":
                        text = b"\n" + text  # after a line torn by a crash, not onto it
                    view = memoryview(text)
                    while view:
                        view = view[os.write(fd, view):]
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                # Compacted (rewritten whole, atomically) once it holds about twice a line per
                # delegation known: amortised, a few bytes rewritten per head appended.
                if size > max(_COMPACT, 2 * known * (len(text) // len(marks) + 1)):
                    merged = parse(path.read_bytes(), {})
                    write_private(path, "".join(
                        json.dumps(m.to_json(d), separators=(",", ":")) + "\n"
                        for d, m in sorted(merged.items())))
            except OSError as exc:
                raise _fail("write", path, exc) from None

    return HeadMemory(load(), load=load, save=save, lock=lock)
