"""Where the master reads contributions from: its own disk, filled beside the round.

:class:`ContributionFiles` holds the own node's files (handed over on the master's host, never
through the exchange) and copies of the other nodes' files, downloaded on a thread of their
own as soon as a listing shows them: the files of the open round first, then those of the
round after it that nodes already sent (``sync: overlapped`` keeps several in flight). The
round thread folds from the copies; it never waits on a download that could have run while it
folded and published the round before (on a slow link that wait was the whole round: one
thread downloading, folding and uploading in turn).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from speedtronic.diloco.exchange import FileInfo, RepoScan, Store, too_large
from speedtronic.retry import TransportError

__all__ = ["ContributionFiles"]

_LOG = logging.getLogger("speedtronic.diloco")

#: A copy of a listed version: the local file, or why the exchange refused it.
Copy = tuple[str | None, "Path | TransportError"]


class ContributionFiles:
    """The master's contribution files. ``own`` (a store under its ``state_dir``) holds its
    own node's files (the only copy: pruned only after the publish that consumed it landed);
    ``fetched/`` holds copies of the other nodes' files, each downloaded once per listed
    version on the ``speedtronic-diloco-fetch`` thread (started when there is something to
    copy, ended when there is nothing left), so the transfers overlap the rounds instead of
    following them. ``fetched/`` is emptied at start (a restarted master reads the exchange
    again) and holds the files of the open round and of the next one, as far as sent; a
    file the exchange refused on download is refused again at the fold, without a second
    download."""

    def __init__(self, store: Store, own: Store | None, state_dir: str | os.PathLike[str]):
        self.store, self.own = store, own
        self.folder = Path(state_dir) / "fetched"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.listed: dict[str, FileInfo] = {}  # the last listing, own files included
        self.local: set[str] = set()  # the paths ``own`` holds
        self.copies: dict[str, Copy] = {}  # path -> (its listed version, the copy or refusal)
        self._cond = threading.Condition()
        self._wanted: dict[str, str | None] = {}  # path -> version to copy, in fetch order
        self._busy: str | None = None  # the path being copied now
        self._busy_released = False  # consumed or unwanted while being copied: it goes
        self._max_bytes = 0
        self._fetching = False  # a fetch thread runs and will look at ``_wanted`` again

    def scan(self) -> RepoScan:
        """The exchange's listing, with the own node's files added."""
        scan = self.store.scan()
        if self.own is not None:
            mine = self.own.scan()
            self.local = {path for files in mine.deltas.values() for path in files.values()}
            for node_id, files in mine.deltas.items():
                scan.deltas.setdefault(node_id, {}).update(files)
            scan.files.update({path: mine.files[path] for path in self.local})
        self.listed = scan.files
        return scan

    def _held(self, path: str) -> Path | TransportError | None:
        """The copy of ``path`` (or its refusal) for its listed version, if any."""
        info, held = self.listed.get(path), self.copies.get(path)
        same = held is not None and info is not None and held[0] == info.version
        return held[1] if held is not None and same else None

    def prefetch(
        self,
        candidates: Mapping[str, Mapping[int, str]],
        max_bytes: int,
        ahead: Sequence[str] = (),
    ) -> None:
        """Have every file of ``candidates`` (the open round's and older), then of ``ahead``
        (the next round's) copied here, once per listed version, on the fetch thread;
        copies of files no longer wanted go. Returns at once: an outage or a vanished file
        leaves the file to the fold, which reads the exchange itself."""
        order = [path for files in candidates.values() for path in files.values()]
        order = [p for p in dict.fromkeys([*sorted(order), *ahead]) if p not in self.local]
        with self._cond:
            self.release(set(self.copies) - set(order))
            self._wanted = {
                p: self.listed[p].version
                for p in order
                if p in self.listed and self._held(p) is None and p != self._busy
            }
            self._max_bytes = max_bytes
            if self._wanted and not self._fetching:
                self._fetching = True
                threading.Thread(
                    target=self._fetch_all, name="speedtronic-diloco-fetch", daemon=True
                ).start()
            self._cond.notify_all()

    def _fetch_all(self) -> None:
        """The fetch thread: copy the wanted files one by one until none is left."""
        while True:
            with self._cond:
                if not self._wanted:  # decided under the lock: a later prefetch starts anew
                    self._busy, self._fetching = None, False
                    self._cond.notify_all()
                    return
                path, version = next(iter(self._wanted.items()))
                del self._wanted[path]
                self._busy, self._busy_released = path, False
                max_bytes = self._max_bytes
            result = self._copy(path, version, max_bytes)
            with self._cond:
                listed, kept = self.listed.get(path), not self._busy_released
                self._busy = None
                if result is not None and kept and listed is not None and listed.version == version:
                    self.copies[path] = result
                elif result is not None and isinstance(result[1], Path):  # let go meanwhile
                    result[1].unlink(missing_ok=True)
                self._tidy()
                self._cond.notify_all()

    def _copy(self, path: str, version: str | None, max_bytes: int) -> Copy | None:
        """Download ``path`` into ``fetched/``: the copy, the exchange's refusal, or None
        (an outage, a vanished file or this disk: the fold reads the exchange)."""
        target = self.folder / path
        try:
            with self.store.local_copy(path, max_bytes=max_bytes) as source:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
            return version, target
        except TransportError as exc:
            if exc.kind == "permanent":  # refused at the fold, as it would be read there
                return version, exc
        except OSError as exc:  # this disk: the fold reads the exchange's file
            _LOG.warning(f"could not keep a copy of {path} ({exc}); read at the fold")
        except Exception as exc:  # never let the fetch thread die with files still wanted
            _LOG.warning(f"could not copy {path} ahead of the fold ({exc}); read at the fold")
        return None

    def settled(self, timeout: float | None = None) -> bool:
        """Wait until the fetch thread copied what it was asked to; False on ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._wanted and self._busy is None, timeout)

    @contextlib.contextmanager
    def open(self, path: str, max_bytes: int) -> Iterator[Path]:
        """A local file with the bytes of ``path`` (at most ``max_bytes``, checked on it): the
        own node's, the copy of its listed version (a copy under way is waited for), or one
        read from the exchange now."""
        with self._cond:
            self._wanted.pop(path, None)  # not copied yet: read below, not twice
            self._cond.wait_for(lambda: self._busy != path)
            held = self._held(path)
        if isinstance(held, TransportError):
            raise held
        if path in self.local and self.own is not None:
            source: contextlib.AbstractContextManager[Path] = self.own.local_copy(path, max_bytes)
        elif held is not None:
            if held.stat().st_size > max_bytes:
                raise too_large(path, held.stat().st_size, max_bytes)
            source = contextlib.nullcontext(held)
        else:
            source = self.store.local_copy(path, max_bytes)
        with source as local:
            yield local

    def _tidy(self) -> None:
        """Nothing held, wanted or being copied (between rounds): ``fetched/`` goes."""
        if not self.copies and not self._wanted and self._busy is None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def remote(self, paths: Iterable[str]) -> list[str]:
        """The ``paths`` the exchange holds (the rest are the own node's, on this disk)."""
        return sorted(set(paths) - self.local)

    def release(self, paths: Iterable[str]) -> None:
        """``paths`` are consumed, refused or no longer wanted: their copies go (one being
        copied goes when its copy ends), and the own node's files from this disk (the publish
        that prunes them landed)."""
        paths = set(paths)
        with self._cond:
            for path in paths:
                self._wanted.pop(path, None)
                self._busy_released |= path == self._busy
                held = self.copies.pop(path, (None, None))[1]
                if isinstance(held, Path):
                    held.unlink(missing_ok=True)
            self._tidy()
        if self.own is not None and paths & self.local:
            self.own.prune(sorted(paths & self.local))
            self.local -= paths
