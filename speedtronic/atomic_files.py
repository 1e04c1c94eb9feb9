"""Atomic files: a reader sees the old file or the new one, never half, whatever kills the writer.

Each file is written to a temp file in the same directory (``.<name>.tmp-<pid>-<thread>``),
flushed and ``fsync``-ed, renamed over the target with ``os.replace`` and the directory
``fsync``-ed; directories created on the way are fsynced into their parents too. A process
killed mid-write leaves at worst a stale temp file (the checkpoint manager removes those).

A write that fails underneath a writer that hides it (torch's zip writer reports a full disk
as ``RuntimeError: ... unexpected pos``) raises the ``OSError`` of the failed write;
:func:`os_reason` says what it means in words (``no space left on device``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = [
    "TEMP_MARK",
    "atomic_json_dump",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_with",
    "fsync_dir",
    "os_reason",
]

TEMP_MARK = ".tmp-"


def fsync_dir(directory: Path) -> None:
    """``fsync`` a directory (its entries survive a crash); a no-op where that is unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _make_dirs(directory: Path) -> None:
    """``mkdir -p`` whose new entries survive a crash: each created directory is fsynced into
    its parent (a file renamed into a directory that was never synced can vanish with it)."""
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for created in reversed(missing):
        try:
            created.mkdir()
        except FileExistsError:  # a concurrent writer made it
            continue
        fsync_dir(created.parent)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)  # raises the precise error


class _Sink:
    """A binary file that keeps the ``OSError`` its ``write`` raised: torch's zip writer turns a
    failed write (a full disk) into ``RuntimeError: ... unexpected pos``, which names neither
    the file nor the cause."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        """``handle.write(data)``, remembering the first ``OSError``."""
        try:
            return self.handle.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


def _atomic_write(path: Path, write: Callable[[Any], None]) -> Path:
    """Write ``path`` through ``write(fileobj)`` via temp file + fsync + rename + dir fsync.

    A write that failed underneath a writer that hides it (torch's zip writer) raises the
    ``OSError`` of the failed write (ENOSPC: a full disk)."""
    path = Path(path)
    _make_dirs(path.parent)
    # pid + thread id: concurrent writers (processes or threads) never share a temp file.
    temp = path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}")
    try:
        with open(temp, "wb") as handle:
            sink = _Sink(handle)
            try:
                write(sink)
            except Exception as exc:
                if sink.error is not None and not isinstance(exc, OSError):
                    raise sink.error from None
                raise
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
    return path


def atomic_torch_save(state: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(state)`` to ``path`` atomically (temp file, fsync, rename, dir fsync)."""
    return _atomic_write(Path(path), lambda handle: torch.save(state, handle))


def atomic_write_with(write: Callable[[Any], Any], path: str | os.PathLike[str]) -> Path:
    """Write ``path`` atomically through ``write(binary_file)`` (a writer that streams)."""
    return _atomic_write(Path(path), write)


def atomic_write_bytes(data: bytes, path: str | os.PathLike[str]) -> Path:
    """Write ``data`` to ``path`` atomically: readers see the old or the new file, never half."""
    return _atomic_write(Path(path), lambda handle: handle.write(data))


def atomic_json_dump(value: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``value`` as indented JSON (plus newline) to ``path`` atomically."""
    data = (json.dumps(value, indent=2, default=str) + "\n").encode("utf-8")
    return atomic_write_bytes(data, path)


def os_reason(exc: OSError) -> str:
    """What an ``OSError`` of a write means, in words (``no space left on device`` for ENOSPC)."""
    reasons = {
        errno.ENOSPC: "no space left on device",
        errno.EDQUOT: "disk quota exceeded (no space left for this user)",
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
    }
    return reasons.get(exc.errno or -1) or exc.strerror or str(exc) or type(exc).__name__
