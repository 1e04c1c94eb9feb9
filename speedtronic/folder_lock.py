"""One process per output folder: an exclusive ``flock`` on ``<run.output_dir>/.speedtronic.lock``.

``speedtronic train`` and ``run`` take it before they write anything in the folder and hold it
for the run's life (`FolderLock.acquire`, released at exit). A second process on the same
folder does not wait: it gets a `FolderInUseError` (a ``ConfigError``, exit 2) naming the
holder, whose pid, host, command and start time the holder wrote into the file::

    error: run.output_dir runs/x is in use by another speedtronic process (pid 4242 on host a,
    speedtronic train since 2025-01-01T10:00:00+00:00); one process per output folder: ...

The kernel drops a ``flock`` when its process dies, however it dies, so a lock file a killed
run left behind is not held: the next run locks it and writes itself in as the holder. The
holder deletes the file when it ends (and the folder, when it created it and left it empty:
a run refused at start leaves no trace); a contender that opened the file just before it was
deleted finds, once it holds the lock, that the name now leads to another file (or none) and
starts over, so two processes never both hold the folder. The file is opened without
following a link and must be a regular file (a FIFO or a link there is refused, never waited
on or written through).

The ranks of one node share its folder: the node's process (or torchrun's agent that
``run.nproc_per_node`` makes of it) holds the lock; rank 0 of a launch by that agent finds
its parent as the holder and goes on; the other ranks write nothing and take no lock.

Limits: ``flock`` is kept by one kernel. Two hosts that share a network volume (NFS, a
``ReadWriteMany`` PVC) may both lock the same folder; give each node its own ``output_dir``
(``{node_id}``), as compose and the k8s manifests do.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from speedtronic.config import ConfigError

__all__ = ["LOCK_FILE", "FolderInUseError", "FolderLock"]

LOCK_FILE = ".speedtronic.lock"
_ATTEMPTS = 20  # the file was replaced between open and lock this often: give up


class FolderInUseError(ConfigError):
    """Another live process holds the output folder; ``pid`` is the holder's (None: unknown)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def _open(path: Path) -> int:
    """The lock file, created when missing; never a link, never anything but a regular file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise ConfigError(f"run.output_dir: cannot lock {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"run.output_dir: {path} is not a regular file; remove it")
    return fd


def _holder(fd: int) -> tuple[str, int | None]:
    """The holder's record in words, and its pid."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return "its holder has not written itself in yet", None
    pid = record["pid"]
    return (
        f"pid {pid} on host {record.get('host', '?')}, {record.get('command', '?')} since "
        f"{record.get('started', '?')}",
        pid,
    )


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class FolderLock:
    """A held lock on one output folder (see the module docstring)."""

    path: Path
    fd: int
    created: Path | None = None  # the outermost folder acquire() made, if any

    @classmethod
    def acquire(cls, folder: str | os.PathLike[str], *, command: str) -> FolderLock:
        """Lock ``folder`` (created when missing) for this process, or raise
        `FolderInUseError` at once naming the live holder. ``command`` is recorded for the
        message another process would print."""
        folder = Path(folder)
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run.output_dir: cannot create {folder}: {exc.strerror}") from None
        path = folder / LOCK_FILE
        for _ in range(_ATTEMPTS):
            fd = _open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                words, pid = _holder(fd)
                os.close(fd)
                raise FolderInUseError(
                    f"run.output_dir {folder} is in use by another speedtronic process ({words}); "
                    "one process per output folder: wait for it to end, or give this run "
                    "another --output-dir",
                    pid,
                ) from None
            if _same_file(fd, path):
                record = {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "command": command,
                    "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                }
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
                return cls(path, fd, missing[-1] if missing else None)
            os.close(fd)  # its holder deleted it as we opened it: lock the new one
        raise ConfigError(f"run.output_dir: {path} keeps being replaced; is another run starting?")

    def release(self) -> None:
        """Delete the lock file (while still holding it), then let go."""
        if _same_file(self.fd, self.path):
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self.fd)
        if self.created is not None:  # the folders acquire() made, while they stay empty
            folder = self.path.parent
            with contextlib.suppress(OSError):
                while True:
                    folder.rmdir()
                    if folder == self.created:
                        break
                    folder = folder.parent
