"""Shared-volume store: ``distributed.repo_id: file:///abs/path``.

Same layout and retry policy as the Hub. Every write goes to a temp file in the target
directory, is fsynced, then renamed over the final name, so a reader never sees half a file;
a "commit" applies its additions in order, then its deletions. File operations are bounded
by the filesystem, not by ``request_timeout`` (docs/diloco.md).

No symbolic link below the root is followed: every directory is opened relative to its parent
and every file with ``O_NOFOLLOW`` (``dir_fd``), so a link planted as ``global/`` or
``nodes/<id>`` cannot send a write outside the exchange or a read to another file (a
permanent ``TransportError`` naming it); listings skip links. A size bound is checked on the
descriptor read (``fstat``), never on a listing. The root itself may be a link (a mount).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from speedtronic.diloco.exchange import Additions, FileInfo, RepoTransport, too_large
from speedtronic.retry import RemoteNotFound, RetryPolicy, TransportError

_LOG = logging.getLogger("speedtronic.diloco")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted under a file's name must not hang the reader.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
#: Where this process can reopen a descriptor by path (Linux); elsewhere reads are copied.
_FD_DIR = Path("/proc/self/fd")


def directory_root(repo_id: str) -> Path:
    """``file:///abs/path`` -> ``Path("/abs/path")``; anything else is a ValueError."""
    parsed = urlparse(repo_id)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ValueError(f"not a file:// repository: {repo_id!r}")
    path = unquote(parsed.path)
    if not path.startswith("/"):
        raise ValueError(f"file:// repository must be absolute: {repo_id!r}")
    return Path(path)


def _symlink_error(path: str) -> TransportError:
    return TransportError(
        f"{path} in the exchange is a symbolic link; the directory store never follows links "
        "(remove the link and let the exchange create a real directory or file there)",
        kind="permanent",
    )


class DirectoryTransport(RepoTransport):
    """A repository that is a directory on a (shared) filesystem."""

    kind = "directory"

    def __init__(self, repo_id: str, retry: RetryPolicy | None = None):
        super().__init__(repo_id, retry)
        self.root = directory_root(repo_id)

    @staticmethod
    def _parts(remote: str) -> list[str]:
        parts = [p for p in remote.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"unsafe repository path: {remote!r}")
        return parts

    # -- no-follow access ------------------------------------------------------------------
    @contextlib.contextmanager
    def _directory(self, parts: list[str], *, create: bool = False) -> Iterator[int]:
        """A descriptor of the directory ``root/parts...``, each component opened with
        ``O_NOFOLLOW`` relative to its parent (created when ``create``). A missing component
        is ``FileNotFoundError``; a link is a permanent ``TransportError``."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for depth, name in enumerate(parts):
                child = self._open_child(fd, name, parts[: depth + 1], create)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _open_child(parent: int, name: str, where: list[str], create: bool) -> int:
        for _ in range(2):  # a directory created by another writer in between is fine
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=parent)
            except OSError as exc:
                if stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
                    raise _symlink_error("/".join(where)) from None
                raise exc
        return os.open(name, _DIR_FLAGS, dir_fd=parent)

    @contextlib.contextmanager
    def _opened(self, remote: str, max_bytes: int | None = None) -> Iterator[int]:
        """A read descriptor of ``remote`` (no link followed anywhere below the root) whose
        ``fstat`` is a regular file of at most ``max_bytes`` bytes."""
        parts = self._parts(remote)
        with self._directory(parts[:-1]) as parent:
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=parent)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _symlink_error(remote) from None
                raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise TransportError(f"{remote} is not a regular file", kind="permanent")
            if max_bytes is not None and info.st_size > max_bytes:
                raise too_large(remote, info.st_size, max_bytes)
            os.set_blocking(fd, True)
            yield fd
        finally:
            os.close(fd)

    def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        with self._opened(path, max_bytes) as fd:
            chunks, total = [], 0
            while max_bytes is None or total <= max_bytes:  # at most max_bytes + 1 bytes
                want = _CHUNK if max_bytes is None else min(_CHUNK, max_bytes + 1 - total)
                chunk = os.read(fd, want)
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        if max_bytes is not None and total > max_bytes:  # it grew after the fstat
            raise too_large(path, total, max_bytes)
        return b"".join(chunks)

    @contextlib.contextmanager
    def local_copy(self, path: str, max_bytes: int | None = None) -> Iterator[Path]:
        """The file itself, pinned: opened once with no link followed and checked against
        ``max_bytes`` on its descriptor, then handed out as ``/proc/self/fd/<n>`` (the very
        file checked, even if it is renamed over meanwhile); a copy where that path does not
        exist. A missing file is ``RemoteNotFound``; too large, a link or not a regular file
        is a permanent ``TransportError``."""
        with contextlib.ExitStack() as stack:
            try:
                fd = stack.enter_context(self._opened(path, max_bytes))
            except (FileNotFoundError, NotADirectoryError):
                raise RemoteNotFound(f"{path} vanished") from None
            if _FD_DIR.is_dir():
                yield _FD_DIR / str(fd)
                return
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="speedtronic-read-"))
            local = Path(tmp) / "file.safetensors"
            with open(local, "wb") as out, os.fdopen(os.dup(fd), "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)
            yield local

    # -- primitives ----------------------------------------------------------------------------
    def _create_repo(self, private: bool) -> None:
        with _writable(self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_temp_files()
        if private:
            with contextlib.suppress(OSError):
                os.chmod(self.root, 0o770)

    def _sweep_temp_files(self, older_than: float = 3600.0) -> None:
        """Remove the temp files of writers killed mid-write (``.<name>.tmp-<pid>-...``,
        untouched for ``older_than`` seconds), when the master opens the exchange."""
        removed = 0
        for _, parent, name, info in self._walk():
            if (
                name.startswith(".")
                and ".tmp-" in name
                and info.st_mtime < time.time() - older_than
            ):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=parent)
                    removed += 1
        if removed:
            _LOG.info("removed %d stale temp files from %s", removed, self.root)

    def _walk(self) -> Iterator[tuple[str, int, str, os.stat_result]]:
        """Every regular file below the root as ``(relative path, parent fd, name, stat)``;
        links are neither reported nor followed, and a file or directory that vanishes while
        we walk is skipped."""
        try:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        stack: list[tuple[int, str]] = [(root, "")]
        try:
            while stack:
                fd, prefix = stack.pop()
                try:
                    with os.scandir(fd) as entries:
                        for entry in entries:
                            with contextlib.suppress(OSError):
                                info = entry.stat(follow_symlinks=False)
                                if stat.S_ISDIR(info.st_mode):
                                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                                    stack.append((child, f"{prefix}{entry.name}/"))
                                elif stat.S_ISREG(info.st_mode):
                                    yield f"{prefix}{entry.name}", fd, entry.name, info
                finally:
                    os.close(fd)
        finally:
            for fd, _ in stack:  # a walk abandoned half-way
                os.close(fd)

    def _grant(self, username: str, permission: str) -> None:
        _LOG.info(
            "directory transport: access to %s is managed by filesystem permissions", username
        )

    def _list(self) -> dict[str, FileInfo]:
        out: dict[str, FileInfo] = {}
        for key, _, _, info in self._walk():
            if not any(part.startswith(".") for part in key.split("/")):
                version = f"{info.st_size}-{info.st_mtime_ns}-{info.st_ino}"
                out[key] = FileInfo(info.st_size, version)
        return out

    def _write(self, remote: str, data: bytes | Path) -> None:
        """Temp file in the target directory (created no-follow, exclusive), fsync, rename
        over the final name, fsync the directory."""
        parts = self._parts(remote)
        with self._directory(parts[:-1], create=True) as parent:
            temp = f".{parts[-1]}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(temp, _WRITE_FLAGS, 0o666, dir_fd=parent)
            try:
                with os.fdopen(fd, "wb") as handle:
                    if isinstance(data, Path):  # a staged file, copied in chunks
                        with open(data, "rb") as source:
                            shutil.copyfileobj(source, handle, _CHUNK)
                    else:
                        handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=parent)
                raise
            with contextlib.suppress(OSError):
                os.fsync(parent)

    def _delete(self, remote: str) -> None:
        parts = self._parts(remote)
        try:
            with self._directory(parts[:-1]) as parent:
                os.unlink(parts[-1], dir_fd=parent)  # a link itself goes, never its target
        except (FileNotFoundError, NotADirectoryError):
            return

    def _commit(self, additions: Additions, deletions: list[str], message: str) -> None:
        with _writable(self.root):
            for remote, data in additions.items():
                self._write(remote, data)
            for remote in deletions:
                self._delete(remote)


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
    errno.ELOOP,
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
