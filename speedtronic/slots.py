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
    worker-<n>.json   the lease: holder, host boot id, pid, beat, renewed_at, released

When is a slot free? Never while its ``.lock`` is held: the kernel holds that lock for the
holder's lifetime and drops it the moment the process dies, however it dies. When the lock
can be taken, the lease decides:

* no lease, or the holder released it on a clean exit -> free;
* the lease was written on this kernel (same ``boot_id``: containers on one host) -> the lock
  is authoritative, the holder is gone -> dead, taken over at once;
* written on another host (a shared network volume whose locks may not reach us) -> dead
  only once the claimant, timing with its *own* monotonic clock, saw the lease unchanged
  (same ``beat``, ``renewed_at`` and instance) for a full lease period. A lease that changes
  while we watch belongs to a live worker; the newcomer moves on. No wall-clock time of
  another host is ever compared with ours: hosts whose clocks disagree by a minute or more
  (``renewed_at`` is the holder's clock, kept for people reading the file) see the same
  liveness, and a lease from another host is taken over after one lease period of silence
  however old its ``renewed_at`` claims to be.

The holder renews its lease (``beat`` + 1) every ``lease_seconds / 3`` from a daemon thread
and releases it on a clean exit (`SlotClaim.release`). A holder that finds another instance's
lease in its file (its slot was taken over: the locks are not shared and it was silent for a
lease period, e.g. a paused VM) logs an error, stops renewing and sets :attr:`SlotClaim.lost`.
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
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from speedtronic.background import Loop
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
    """The content of ``<slot>.json``. ``beat`` counts the holder's renewals; ``renewed_at`` is
    the holder's wall clock (time.time), for people: liveness never compares it with ours."""

    slot: str
    instance: str
    hostname: str
    boot_id: str
    pid: int
    renewed_at: float
    lease_seconds: float
    released: bool = False
    beat: int = 0

    @classmethod
    def read(cls, path: Path) -> Lease | None:
        """The lease at ``path``; None when missing or unreadable (a torn write is free). A
        lease written before ``beat`` existed reads with ``beat`` 0."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def fingerprint(self) -> tuple[str, int, float]:
        """What changes with every renewal (instance, beat, renewed_at): a claimant compares
        these, never the times themselves."""
        return (self.instance, self.beat, self.renewed_at)


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
        self._renewer = Loop(
            "speedtronic-slot-lease", self._renew_tick, lease.lease_seconds / 3.0, wait_first=True
        )
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
        """Re-write the lease with the next ``beat`` and a fresh ``renewed_at``; False (and
        logged once) when another instance's lease is found there, which only happens if the
        slot's locks are not shared between the hosts that use it."""
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
        self.lease = replace(self.lease, renewed_at=self._clock(), beat=self.lease.beat + 1)
        atomic_json_dump(asdict(self.lease), self.path)
        return True

    def start(self) -> SlotClaim:
        """Renew the lease every ``lease_seconds / 3`` in a daemon thread; returns self."""
        if not self._renewer.stopping:
            self._renewer.start()
        return self

    def _renew_tick(self) -> bool:
        try:
            return not self.renew()
        except OSError as exc:  # a volume hiccup: the next renewal tries again
            _LOG.warning("could not renew worker slot %s: %s", self.lease.slot, exc)
            return False

    def release(self) -> None:
        """Stop renewing, mark the lease released and drop the life lock (idempotent)."""
        self._renewer.stop(timeout=5.0)
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
    directory: str | os.PathLike[str],
    *,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    kernel: str | None = None,
) -> SlotClaim:
    """Claim the lowest free or dead worker slot in ``directory`` (created when missing).

    A slot whose lease comes from another host may be dead (its holder's host is gone) or
    alive (its lock does not reach us); the claim watches such leases, on its own monotonic
    clock, and takes one over only after it stayed unchanged for a lease period; it waits for
    them (at most ``2 * lease_seconds``) before it opens a new slot, so a worker rescheduled
    onto another host resumes the slot it had.

    Args:
        directory: the shared slots directory (``distributed.slots_dir``).
        lease_seconds: how long a lease from another host must stay unchanged to be dead.
        clock: wall clock (seconds) for the lease's ``renewed_at`` (informational).
        monotonic: this process's elapsed-time clock (seconds), for every wait and watch.
        sleep: injectable for tests.
        kernel: this host's boot id (default: `boot_id()`).

    Returns:
        A started `SlotClaim` (renewing); call ``release()`` on a clean exit.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    kernel = boot_id() if kernel is None else kernel
    watch = _Watch(lease_seconds)
    give_up_waiting = monotonic() + 2.0 * lease_seconds
    while True:
        with _locked(root / "claim.lock"):
            waiting = False
            for number in itertools.count(1):
                slot = f"{PREFIX}-{number}"
                lock_path, lease_path = root / f"{slot}.lock", root / f"{slot}.json"
                unused = not lock_path.exists() and not lease_path.exists()
                if unused and waiting and monotonic() < give_up_waiting:
                    break  # rather wait for a pending slot than open a new one
                fd = _try_life_lock(lock_path)
                if fd is None:
                    continue  # a live holder on a kernel that shares our locks
                lease = Lease.read(lease_path)
                state = watch.classify(slot, lease, kernel, monotonic())
                if unused or state == "free":
                    return _take(root, slot, fd, lease_seconds, kernel, clock)
                os.close(fd)
                waiting = waiting or state == "pending"
        sleep(min(lease_seconds / 3.0, 5.0))


class _Watch:
    """A claimant's watch of other hosts' leases, timed only by its own monotonic clock."""

    def __init__(self, lease_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self.first: dict[str, tuple[tuple[str, int, float], float]] = {}  # slot -> (seen, at)
        self.live: set[str] = set()

    def classify(self, slot: str, lease: Lease | None, kernel: str, now: float) -> str:
        """``free`` (take it), ``live`` (changed while we watched: a running holder) or
        ``pending`` (unchanged for less than a lease period: wait)."""
        if lease is None or lease.released:
            return "free"
        if kernel and lease.boot_id == kernel:
            return "free"  # same kernel: the life lock was free, so its holder is gone
        if slot in self.live:
            return "live"
        seen = lease.fingerprint()
        first = self.first.setdefault(slot, (seen, now))
        if first[0] != seen:
            self.live.add(slot)
            return "live"
        theirs = lease.lease_seconds  # a holder with a longer lease renews less often
        period = max(self.lease_seconds, theirs if isinstance(theirs, (int, float)) else 0.0)
        return "free" if now - first[1] >= period else "pending"


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
