"""Worker slots: a stable node id (``worker-<n>``) for workers started without one.

A compose replica's hostname is a fresh container id after every recreation, so a worker
that took its node id from ``HOSTNAME`` would lose its checkpoints each time. Instead, a
worker without an explicit node id claims the lowest free or dead slot in ``slots_dir`` (a
directory on the volume every worker shares) and uses the slot name as its node id; its
output paths contain ``{node_id}`` and therefore land on that slot's checkpoints. Kubernetes
StatefulSet pods need no slot: their pod name is already a stable, unique node id.

Layout of ``slots_dir``::

    claim.lock        flock'ed while a worker picks its slot (milliseconds)
    worker-<n>.lock   flock'ed by the slot's holder for as long as it runs
    worker-<n>.json   the lease: holder, host boot id, pid, renewed_at, released

When is a slot free? Never while its ``.lock`` is held: the kernel holds that lock for the
holder's lifetime and drops it the moment the process dies, however it dies. When the lock
can be taken, the lease decides:

* no lease, or the holder released it on a clean exit -> free;
* the lease was written on this kernel (same ``boot_id``: containers on one host) -> the lock
  is authoritative, the holder is gone -> dead, taken over at once;
* written on another host (a shared network volume whose locks may not reach us) -> dead
  only once it was not renewed for ``lease_seconds``. A lease that is renewed while we wait
  belongs to a live worker; the newcomer moves on.

The holder renews its lease every ``lease_seconds / 3`` from a daemon thread and releases it
on a clean exit (`SlotClaim.release`).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from speedtronic.checkpoint import atomic_json_dump

__all__ = ["DEFAULT_LEASE_SECONDS", "Lease", "SlotClaim", "boot_id", "claim_slot"]

_LOG = logging.getLogger("speedtronic.slots")

#: Seconds without renewal after which a lease written on another host counts as dead.
DEFAULT_LEASE_SECONDS = 30.0
PREFIX = "worker"


def boot_id() -> str:
    """This kernel's boot id (shared by every container on one host), or ``""``."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Lease:
    """The content of ``<slot>.json``; ``renewed_at`` is wall-clock seconds (time.time)."""

    slot: str
    instance: str
    hostname: str
    boot_id: str
    pid: int
    renewed_at: float
    lease_seconds: float
    released: bool = False

    @classmethod
    def read(cls, path: Path) -> Lease | None:
        """The lease at ``path``; None when missing or unreadable (a torn write is free)."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{name: data[name] for name in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


class SlotClaim:
    """This process's hold on one slot: the life lock, the lease, and its renewal thread."""

    def __init__(
        self,
        directory: Path,
        lease: Lease,
        lock_fd: int,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.lease = lease
        self._lock_fd: int | None = lock_fd
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    @property
    def node_id(self) -> str:
        """The slot name, used as the node id (``worker-<n>``)."""
        return self.lease.slot

    @property
    def path(self) -> Path:
        """``<slots_dir>/<slot>.json``."""
        return self.directory / f"{self.lease.slot}.json"

    def renew(self) -> bool:
        """Re-write the lease with a fresh ``renewed_at``; False (and logged once) when another
        instance's lease is found there, which only happens if the slot's locks are not shared
        between the hosts that use it."""
        current = Lease.read(self.path)
        if current is not None and current.instance != self.lease.instance:
            if not self.lost:
                _LOG.error(
                    "worker slot %s was taken over by %s (pid %s): the slot's lock is not "
                    "shared between hosts; use explicit node ids on this volume",
                    self.lease.slot,
                    current.hostname,
                    current.pid,
                )
            self.lost = True
            return False
        self.lease = replace(self.lease, renewed_at=self._clock())
        atomic_json_dump(asdict(self.lease), self.path)
        return True

    def start(self) -> SlotClaim:
        """Renew the lease every ``lease_seconds / 3`` in a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._renew_loop, name="speedtronic-slot-lease", daemon=True
            )
            self._thread.start()
        return self

    def _renew_loop(self) -> None:
        interval = self.lease.lease_seconds / 3.0
        while not self._stop.wait(interval):
            try:
                if not self.renew():
                    return
            except OSError as exc:  # a volume hiccup: the next renewal tries again
                _LOG.warning("could not renew worker slot %s: %s", self.lease.slot, exc)

    def release(self) -> None:
        """Stop renewing, mark the lease released and drop the life lock (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._lock_fd is None:
            return
        try:
            if not self.lost:
                self.lease = replace(self.lease, released=True, renewed_at=self._clock())
                atomic_json_dump(asdict(self.lease), self.path)
        except OSError as exc:
            _LOG.warning("could not mark worker slot %s released: %s", self.lease.slot, exc)
        finally:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def __enter__(self) -> SlotClaim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created when missing) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _try_life_lock(path: Path) -> int | None:
    """An fd holding the slot's life lock, or None when a live holder has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def claim_slot(
    directory: str | os.PathLike,
    *,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    kernel: str | None = None,
) -> SlotClaim:
    """Claim the lowest free or dead worker slot in ``directory`` (created when missing).

    A slot whose lease comes from another host and is still fresh may be dead (its holder's
    host is gone) or alive (its lock does not reach us); the claim waits for such leases to
    expire (waiting at most ``2 * lease_seconds``) before it opens a new slot, so a worker
    rescheduled onto another host resumes the slot it had.

    Args:
        directory: the shared slots directory (``distributed.slots_dir``).
        lease_seconds: how long a lease from another host stays valid without renewal.
        clock: wall clock (seconds), injectable for tests.
        sleep: injectable for tests.
        kernel: this host's boot id (default: `boot_id()`).

    Returns:
        A started `SlotClaim` (renewing); call ``release()`` on a clean exit.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    kernel = boot_id() if kernel is None else kernel
    first_seen: dict[str, float] = {}  # slot -> renewed_at when first found pending
    give_up_waiting = clock() + 2.0 * lease_seconds
    while True:
        with _locked(root / "claim.lock"):
            waiting = False
            for number in itertools.count(1):
                slot = f"{PREFIX}-{number}"
                lock_path, lease_path = root / f"{slot}.lock", root / f"{slot}.json"
                unused = not lock_path.exists() and not lease_path.exists()
                if unused and waiting and clock() < give_up_waiting:
                    break  # rather wait for a pending slot than open a new one
                fd = _try_life_lock(lock_path)
                if fd is None:
                    continue  # a live holder on a kernel that shares our locks
                lease = Lease.read(lease_path)
                state = _classify(lease, kernel, lease_seconds, clock(), first_seen)
                if unused or state == "free":
                    return _take(root, slot, fd, lease_seconds, kernel, clock)
                os.close(fd)
                waiting = waiting or state == "pending"
        sleep(min(lease_seconds / 3.0, 5.0))


def _classify(
    lease: Lease | None,
    kernel: str,
    lease_seconds: float,
    now: float,
    first_seen: dict[str, float],
) -> str:
    """``free`` (take it), ``live`` (renewed while we waited) or ``pending`` (wait)."""
    if lease is None or lease.released:
        return "free"
    if kernel and lease.boot_id == kernel:
        return "free"  # same kernel: the life lock was free, so its holder is gone
    if now - lease.renewed_at > lease_seconds:
        return "free"
    seen = first_seen.setdefault(lease.slot, lease.renewed_at)
    return "live" if lease.renewed_at != seen else "pending"


def _take(
    root: Path,
    slot: str,
    fd: int,
    lease_seconds: float,
    kernel: str,
    clock: Callable[[], float],
) -> SlotClaim:
    previous = Lease.read(root / f"{slot}.json")
    lease = Lease(
        slot=slot,
        instance=secrets.token_hex(8),
        hostname=socket.gethostname(),
        boot_id=kernel,
        pid=os.getpid(),
        renewed_at=clock(),
        lease_seconds=float(lease_seconds),
    )
    try:
        atomic_json_dump(asdict(lease), root / f"{slot}.json")
    except BaseException:
        os.close(fd)
        raise
    if previous is not None:
        _LOG.info(
            "took over worker slot %s from %s (pid %s, %s)",
            slot,
            previous.hostname,
            previous.pid,
            "released" if previous.released else "gone",
        )
    else:
        _LOG.info("claimed new worker slot %s", slot)
    return SlotClaim(root, lease, fd, clock=clock).start()
