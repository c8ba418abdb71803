"""The disk faults of a SQLite trial: the journal on a small file system of its own, which the
harness fills up or makes read-only while the trial runs.

- ``disk_full``: a tmpfs with a size limit; the harness fills what is free with a file of its
  own, keeps it full for a while, then deletes the file (the disk has room again).
- ``journal_readonly``: an ext4 file system in an image file, mounted through a loop device
  with ``errors=remount-ro``; the harness triggers a file-system error (``trigger_fs_error`` in
  sysfs, the file system frozen meanwhile: ``make_readonly``), and the kernel makes it
  read-only at once, files already open included (a plain ``mount -o remount,ro`` is refused
  while a process holds a file open for writing, and root ignores file modes). It stays
  read-only until it is unmounted: the harness unmounts it once the trial's processes are
  gone, checks it with e2fsck and mounts it again before the fresh supervisor reconciles.

Only the journal lives there: the provider's ledger and the keys stay on the trial's folder.
Mounting needs root; every mount is undone, whatever happens.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

from tether._chaos.plan import DISK_FAULTS
from tether._core.errors import UserError

TMPFS_SIZE = "8m"
IMAGE_SIZE = 16 * 1024 * 1024
CHUNK = 64 * 1024


def check_can_mount() -> None:
    """A UserError before any trial runs when this host cannot mount the trials' disks."""
    if os.geteuid() != 0:
        raise UserError(f"{', '.join(DISK_FAULTS)} mount a small file system for each trial's "
                        "journal: run tether chaos as root")
    missing = [tool for tool in ("mount", "umount", "findmnt", "fsfreeze", "mkfs.ext4", "e2fsck")
               if shutil.which(tool) is None]
    if missing:
        raise UserError(f"{', '.join(DISK_FAULTS)} need {', '.join(missing)} (install "
                        "util-linux and e2fsprogs)")


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}")


class JournalDisk:
    """``disk = JournalDisk(folder, fault).mount()``; the journal goes in ``disk.path``."""

    def __init__(self, folder: Path, fault: str) -> None:
        if fault not in DISK_FAULTS:
            raise ValueError(fault)
        self.fault = fault
        self.path = folder / "disk"
        self.image = folder / "disk.img"
        self.filler = self.path / ".filler"
        self.mounted = False

    def mount(self) -> JournalDisk:
        self.path.mkdir(exist_ok=True)
        if self.fault == "disk_full":
            _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tether-chaos",
                 str(self.path))
        else:
            with self.image.open("wb") as f:
                f.truncate(IMAGE_SIZE)
            _run("mkfs.ext4", "-q", "-F", "-m", "0", str(self.image))
            self._mount_image()
        self.mounted = True
        return self

    def _mount_image(self) -> None:
        _run("mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.path))

    # -- the faults -----------------------------------------------------------------------------
    def fill(self) -> int:
        """Fill every free byte with a file of the harness's own; returns how many bytes."""
        written = 0
        block = b"\0" * CHUNK
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            size = CHUNK
            while size:
                try:
                    written += os.write(fd, block[:size])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    size //= 2  # the last pages, down to the byte
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        """The disk has room again."""
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def make_readonly(self) -> None:
        """An error of the file system: the kernel makes it read-only, open files included.

        Struck while the file system is frozen: every write it acknowledged is then on disk
        and none is under way. An error that strikes during an fsync can lose the writes that
        fsync then reports done (ext4: one error in three to ten; tests/test_disk_faults.py), a
        disk that lies, which no journal survives and a trial would misread as a rollback.
        The writers held by the freeze meet the error once it thaws.

        The freeze is made by a watchdog of its own session, which thaws the file system if
        this process dies first (a SIGKILL runs no ``finally``): left frozen, it would hold
        every writer on it, the trial's and the next run's, in uninterruptible sleep. The
        watchdog says "frozen" once its freeze is done, then waits for a line on a pipe from
        this process: the pipe's end without it (this process gone, or its thaw failed)
        thaws it, and nothing thaws it while this process still holds the freeze."""
        device = self._device()
        watchdog = subprocess.Popen(
            # SIGPIPE ignored: with this process gone, its "frozen" meets a closed pipe.
            ["sh", "-c", 'trap "" PIPE; fsfreeze --freeze "$0" || exit 1; echo frozen; '
             'read -r _ || exec fsfreeze --unfreeze "$0"', str(self.path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        assert watchdog.stdin is not None and watchdog.stdout is not None
        thawed = False
        try:
            ready, _, _ = select.select([watchdog.stdout], [], [], 60.0)
            if not ready or watchdog.stdout.readline() != b"frozen\n":
                raise RuntimeError(f"fsfreeze --freeze {self.path} failed: "
                                   f"{_said(watchdog) if ready else 'no answer in 60 s'}")
            try:
                Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text("tether chaos\n")
            finally:
                _run("fsfreeze", "--unfreeze", str(self.path))
                thawed = True
        finally:
            with contextlib.suppress(BrokenPipeError):
                if thawed:  # it ends without a thaw; otherwise the pipe's end makes it try one
                    watchdog.stdin.write(b"thawed\n")
                watchdog.stdin.close()
            watchdog.stdout.close()  # (its later words meet a closed pipe: ignored)
            assert watchdog.stderr is not None
            watchdog.stderr.close()
            if thawed:
                watchdog.wait()
            # Otherwise not waited for: a freeze still under way thaws once it is done.

    def _device(self) -> str:
        done = subprocess.run(["findmnt", "-n", "-o", "SOURCE", "--target", str(self.path)],
                              capture_output=True, text=True, check=True)
        return Path(os.path.realpath(done.stdout.strip())).name

    def clear(self) -> None:
        """Undo the fault once no process of the trial runs any more: room again, or the file
        system checked and mounted read-write again."""
        if not self.mounted:
            return
        if self.fault == "disk_full":
            self.free()
            return
        self._unmount()
        _run_fsck(self.image)
        self._mount_image()
        self.mounted = True

    def _unmount(self) -> None:
        if not self.mounted:
            return
        # The trial's processes were just killed: their files close within moments.
        deadline = time.monotonic() + 5.0
        while subprocess.run(["umount", str(self.path)], capture_output=True,
                             check=False).returncode != 0:
            if time.monotonic() > deadline:  # still held: detach it, never leave it mounted
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True,
                               check=False)
                break
            time.sleep(0.05)
        self.mounted = False

    def close(self) -> None:
        """Always called: nothing stays mounted."""
        self._unmount()
        with contextlib.suppress(FileNotFoundError):
            self.image.unlink()


def _said(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stderr is not None
    said = proc.stderr.read().decode(errors="replace").strip()  # it ended: read to its end
    return said or f"exit {proc.wait()}"


def _run_fsck(image: Path) -> None:
    # 0: clean, 1: errors corrected; anything else is a file system it could not repair.
    done = subprocess.run(["e2fsck", "-f", "-y", str(image)], capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"e2fsck {image} failed ({done.returncode}): {done.stdout[-500:]}")
