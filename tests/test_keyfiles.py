"""Key files on disk: private whatever the umask, created atomically, safe when several
processes start on one fresh journal at once; a bad key path is one line; a lock file planted
as a symbolic link is not followed, and a key directory another user owns is refused."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import tether
from tests.test_cli import one_line_error


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        tether.KeyRing.init(tmp_path / "a" / "keys")
        tether.KeyRing.load_or_init(tmp_path / "b")
    finally:
        os.umask(old)
    for directory in (tmp_path / "a" / "keys", tmp_path / "b"):
        assert mode(directory) == 0o700
        assert mode(directory / "signing.json") == 0o600
        assert mode(directory / "trusted.json") == 0o600
        assert not [p for p in directory.iterdir() if p.name.startswith(".signing")]


def test_loading_keys_an_older_tether_left_open_makes_them_private(tmp_path: Path) -> None:
    tether.KeyRing.init(tmp_path / "keys")
    for path, loose in ((tmp_path / "keys", 0o777), (tmp_path / "keys" / "trusted.json", 0o666),
                        (tmp_path / "keys" / "signing.json", 0o644)):
        os.chmod(path, loose)
    tether.KeyRing.load(tmp_path / "keys")
    assert mode(tmp_path / "keys") == 0o700
    assert mode(tmp_path / "keys" / "trusted.json") == 0o600
    assert mode(tmp_path / "keys" / "signing.json") == 0o600


STARTER = r"""
import sys, time
from pathlib import Path
import tether

url, go = sys.argv[1], Path(sys.argv[2])
print("ready", flush=True)
deadline = time.monotonic() + 30
while not go.exists() and time.monotonic() < deadline:
    pass  # spin: all four leave the barrier within microseconds of each other

# What a supervisor, worker or CLI does first with the journal's key directory. (The
# journal's own schema creation is raced by tests of the journal.)
print(tether.KeyRing.load_or_init(tether.Journal(url).keys_dir).signer.key_id, flush=True)
"""


async def test_four_processes_on_a_fresh_journal_share_one_key(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j' / 'journal.db'}"
    (tmp_path / "j").mkdir()
    go = tmp_path / "go"
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", STARTER, url, str(go), cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE) for _ in range(4)]
    for proc in procs:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
    go.touch()
    results = [await proc.communicate() for proc in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e.decode() for _, e in results]
    ids = {out.decode().strip() for out, _ in results}
    assert len(ids) == 1
    keys = tmp_path / "j" / "keys"
    assert tether.KeyRing.load(keys).signer.key_id in ids
    assert mode(keys) == 0o700 and mode(keys / "trusted.json") == 0o600


def test_keys_init_on_a_file_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    assert "not-a-dir" in one_line_error(["keys", "init", "--keys", str(a_file)])
    assert "not-a-dir" in one_line_error(["keys", "init", "--keys", str(a_file / "keys")])
    assert a_file.read_text() == "x"
    # A place nobody can create a directory in, root included (procfs).
    assert "/proc/tether-keys" in one_line_error(["keys", "init", "--keys", "/proc/tether-keys"])


def test_a_lock_file_planted_as_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """`keys/.lock` was opened with O_CREAT through symbolic links: whoever could plant one
    made every tether process create (as its user, root in a container) the file it names."""
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    (keys / ".lock").symlink_to(elsewhere)
    with pytest.raises(tether.errors.UserError, match="cannot lock"):
        tether.KeyRing.init(keys)
    assert not elsewhere.exists()


def test_keys_in_a_directory_another_user_owns_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key directory another user created first (a shared working directory) is theirs to
    rewrite: `trusted.json` there pins whatever root they like, whatever its mode."""
    keys = tmp_path / "keys"
    tether.KeyRing.init(keys)
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with pytest.raises(tether.errors.UserError, match="belongs to user"):
        tether.KeyRing.load(keys)
    with pytest.raises(tether.errors.UserError, match="belongs to user"):
        tether.KeyRing.init(tmp_path / "keys")


# A lock waited on past its patience, then a fork (a fork-started worker pool of the user's),
# then the holder lets go: is the lock free for other processes while the fork lives?
_GIVEN_UP_THEN_FORKED = """
import os, subprocess, sys, time
from pathlib import Path
from tether._runtime import keys
keys.LOCK_PATIENCE = 0.2
d = Path(sys.argv[1])
holder = subprocess.Popen(["flock", str(d / ".lock"), "sleep", "1"])
while subprocess.run(["flock", "-n", str(d / ".lock"), "true"]).returncode == 0:
    time.sleep(0.01)  # until the holder has it
try:
    with keys._locked(d):
        raise SystemExit("took a lock another process held")
except keys.LockTimeout:
    pass
child = os.fork()
if child == 0:
    time.sleep(10)
    os._exit(0)
try:
    holder.wait()
    deadline = time.monotonic() + 5.0
    while subprocess.run(["flock", "-n", str(d / ".lock"), "true"]).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit("still locked while the forked child lives")
        time.sleep(0.01)
finally:
    os.kill(child, 9)
    os.waitpid(child, 0)
print("free")
"""


def test_a_lock_wait_given_up_leaves_the_lock_free_once_its_holder_lets_go(
        tmp_path: Path) -> None:
    """The thread left waiting for the key directory's lock lets it go the moment it gets it,
    even where a child forked meanwhile shares its descriptor."""
    (tmp_path / ".lock").touch()
    done = subprocess.run([sys.executable, "-c", _GIVEN_UP_THEN_FORKED, str(tmp_path)],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.strip() == "free", done.stderr[-500:]
