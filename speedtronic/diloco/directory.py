"""Shared-volume transport: ``distributed.repo_id: file:///abs/path``.

Same layout and retry policy as the Hub. Every write goes to a temp file in the target
directory, is fsynced, then renamed over the final name, so a reader never sees half a file.
A "commit" applies its additions in order (weights, processed set, version record last) and
then its deletions. Local file operations are bounded by the filesystem, not by
``request_timeout`` (documented in docs/diloco.md).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

from speedtronic.checkpoint import atomic_write_bytes
from speedtronic.diloco.transport import (
    FileInfo,
    RemoteNotFound,
    RepoTransport,
    RetryPolicy,
    TransportError,
)

__all__ = ["DirectoryTransport", "directory_root"]

_LOG = logging.getLogger("speedtronic.diloco")


def directory_root(repo_id: str) -> Path:
    """``file:///abs/path`` -> ``Path("/abs/path")``; anything else is a ValueError."""
    parsed = urlparse(repo_id)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ValueError(f"not a file:// repository: {repo_id!r}")
    path = unquote(parsed.path)
    if not path.startswith("/"):
        raise ValueError(f"file:// repository must be absolute: {repo_id!r}")
    return Path(path)


class DirectoryTransport(RepoTransport):
    """A repository that is a directory on a (shared) filesystem."""

    kind = "directory"

    def __init__(self, repo_id: str, retry: RetryPolicy | None = None):
        super().__init__(repo_id, retry)
        self.root = directory_root(repo_id)

    def _path(self, remote: str) -> Path:
        parts = [p for p in remote.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"unsafe repository path: {remote!r}")
        return self.root.joinpath(*parts)

    def _create_repo(self, private: bool) -> None:
        with _writable(self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_temp_files()
        if private:
            with contextlib.suppress(OSError):
                os.chmod(self.root, 0o770)

    def _sweep_temp_files(self, older_than: float = 3600.0) -> int:
        """Remove the temp files of writers killed mid-write (``.<name>.tmp-<pid>-...``,
        untouched for ``older_than`` seconds); returns how many went. Runs when the master
        opens the exchange."""
        removed = 0
        cutoff = time.time() - older_than
        for path in self.root.rglob(".*.tmp-*"):
            with contextlib.suppress(OSError):
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
        if removed:
            _LOG.info("removed %d stale temp files from %s", removed, self.root)
        return removed

    def _grant(self, username: str, permission: str) -> None:
        _LOG.info(
            "directory transport: access to %s is managed by filesystem permissions", username
        )

    def _list(self) -> dict[str, FileInfo]:
        if not self.root.exists():
            return {}
        out: dict[str, FileInfo] = {}
        for path in self.root.rglob("*"):
            if path.name.startswith("."):
                continue
            with contextlib.suppress(OSError):  # a file may vanish while we list
                info = path.stat()
                if stat.S_ISREG(info.st_mode):
                    version = f"{info.st_size}-{info.st_mtime_ns}-{info.st_ino}"
                    key = path.relative_to(self.root).as_posix()
                    out[key] = FileInfo(info.st_size, version)
        return out

    @contextlib.contextmanager
    def local_copy(self, path: str) -> Iterator[Path]:
        """The file itself (no copy); a missing file is ``RemoteNotFound``."""
        local = self._path(path)
        if not local.is_file():
            raise RemoteNotFound(f"{path} vanished")
        yield local

    def _read(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    def _write(self, remote: str, data: bytes) -> None:
        atomic_write_bytes(data, self._path(remote))

    def _commit(self, additions: Mapping[str, bytes], deletions: list[str], message: str) -> None:
        with _writable(self.root):
            for remote, data in additions.items():
                self._write(remote, data)
            for remote in deletions:
                self._path(remote).unlink(missing_ok=True)


#: Write errors that no retry fixes: the exchange directory is misconfigured.
_PERMANENT_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EINVAL,
    errno.ENAMETOOLONG,
}


@contextlib.contextmanager
def _writable(root: Path) -> Iterator[None]:
    """Turn a write that can never succeed (no permission, read-only, a path that cannot be
    created) into a permanent ``TransportError``; other I/O errors stay transient."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _PERMANENT_ERRNOS:
            raise TransportError(
                f"cannot write the exchange directory {root}: {exc.strerror or exc}",
                kind="permanent",
            ) from None
        raise
