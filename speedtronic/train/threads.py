"""Threads that fit: ``runtime.threads`` applied to torch, and kept fitting while siblings come
and go.

`ThreadBudget.start` runs where the runtime is set up, before the model is built: it registers
this process with the host's `SiblingRegistry`, plans the count (`speedtronic.train.cpus`:
affinity, cgroup quota, ``LOCAL_WORLD_SIZE``, ``OMP_NUM_THREADS``, an explicit count), calls
``torch.set_num_threads`` and logs one line, e.g.::

    threads: 1 (auto: 2 CPUs in affinity, no cgroup quota, 3 training processes on this host)

The README's loop starts three independent training processes on one host; the first one to
start sees only itself. So under ``auto`` the budget is a hook on the trainer's logger: at most
every `REFRESH_SECONDS` it counts its siblings again and, when the count changed, sets the new
number and logs ``threads: 2 -> 1 (...)``. torch keeps a thread count per thread, so every
thread that emits an event (the training loop, the DiLoCo master's aggregation thread) adopts
the current count on its next event. The registration ends with the run (``train_end``) or
the process.

The registry is a folder per user (``$XDG_RUNTIME_DIR/speedtronic/threads``, else
``<tmp>/speedtronic-<uid>/threads``) with one file per live process, ``flock`` ed by its
owner for as long as it lives: the kernel drops the lock the moment the process dies, however
it dies, so a file whose lock can be taken is a dead entry (removed, never counted), and a
reused pid is never mistaken for a live sibling. Containers have their own ``/tmp`` and their
own quota, so each counts only itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from speedtronic.json_types import JSON, JSONView
from speedtronic.train.cpus import (
    ThreadPlan,
    affinity_cpus,
    cgroup_cpu_quota,
    local_world_size,
    omp_threads,
    plan_threads,
)

__all__ = ["REFRESH_SECONDS", "SiblingRegistry", "ThreadBudget", "registry_dir"]

_LOG = logging.getLogger("speedtronic.threads")

#: Seconds between two counts of the sibling processes (under ``runtime.threads: auto``).
REFRESH_SECONDS = 2.0
_SUFFIX = ".lock"


def registry_dir(environ: Mapping[str, str]) -> Path:
    """This user's sibling registry: ``$XDG_RUNTIME_DIR/speedtronic/threads`` when that is
    set, else ``<tmp>/speedtronic-<uid>/threads``."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "speedtronic" / "threads"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"speedtronic-{uid}" / "threads"


def _private_dir(path: Path) -> None:
    """Create ``path`` and its parent (mode 0700), one level at a time below the base folder
    (``$XDG_RUNTIME_DIR`` or the temp folder), and refuse a level that is a link, not a
    folder, or another user's (a ``PermissionError``) before the next one is made: nothing is
    ever created inside a link's target, and nobody else can plant entries."""
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    for folder in (path.parent, path):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)  # never follows a link that is already there
        info = folder.lstat()
        foreign = hasattr(os, "getuid") and info.st_uid != os.getuid()
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or foreign:
            raise PermissionError(f"{folder} is a link, not a folder, or another user's")


class SiblingRegistry:
    """The training processes of one user on one host: one ``flock`` ed file each.

    `register` adds this process (with the CPUs it may use), `count` returns the live
    processes whose CPUs overlap the given ones, this one included, and `release` removes
    this process. Any ``OSError`` (a read-only or foreign folder) leaves the registry off:
    the process then counts only itself.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._fd: int | None = None
        self._path: Path | None = None
        self.error: str | None = None

    def register(self, cpus: Iterable[int]) -> bool:
        """Add this process; False (with `error` set) when the registry cannot be used."""
        import fcntl

        if self._fd is not None:
            return True
        record = json.dumps({"pid": os.getpid(), "cpus": sorted(cpus)})
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        temporary = self.directory / f".{name}.tmp"
        try:
            _private_dir(self.directory)
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # locked before the file has its final name
                os.write(fd, record.encode())
                os.replace(temporary, self.directory / f"{name}{_SUFFIX}")
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    temporary.unlink()
                raise
        except OSError as exc:
            self.error = f"{self.directory}: {exc.strerror or exc}"
            return False
        self._fd, self._path = fd, self.directory / f"{name}{_SUFFIX}"
        return True

    def count(self, cpus: Iterable[int]) -> int:
        """Live registered processes whose CPUs overlap ``cpus``, this one included (at
        least 1). Dead entries (their lock is free) are removed on the way."""
        import fcntl

        mine = frozenset(cpus)
        pids = {os.getpid()}
        try:
            entries = list(self.directory.glob(f"*{_SUFFIX}"))
        except OSError:
            return 1
        for entry in entries:
            try:  # never blocks (a FIFO named *.lock) and never follows a link
                fd = os.open(entry, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue  # removed meanwhile, or a link
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue  # a FIFO, socket or device: no entry of ours
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # held: a live process
                    record = json.loads(os.read(fd, 1 << 16) or b"{}")
                    if not mine or mine & set(record.get("cpus") or mine):
                        pids.add(int(record.get("pid", -1)))
                    continue
                if entry != self._path:  # free: its owner is gone
                    with contextlib.suppress(OSError):
                        entry.unlink()
            except (OSError, ValueError, TypeError, AttributeError):
                continue
            finally:
                os.close(fd)
        return len(pids)

    def release(self) -> None:
        """Remove this process's entry (idempotent)."""
        if self._fd is None:
            return
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()
        os.close(self._fd)
        self._fd = self._path = None


def _set_torch_threads(count: int) -> None:
    import torch

    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


class ThreadBudget:
    """This process's torch thread count (``runtime.threads``), applied and kept current.

    A logger hook (``on_event``; ``wants_all_steps``): under ``auto`` it re-plans at most every
    ``refresh_seconds`` as siblings start and end, and makes the thread that emits adopt the
    current count. `plan` is the current `ThreadPlan`.
    """

    wants_all_steps = True

    def __init__(
        self,
        setting: int | str,
        *,
        environ: Mapping[str, str],
        registry: SiblingRegistry | None = None,
        cpus: Callable[[], frozenset[int]] = affinity_cpus,
        quota: Callable[[], float | None] = cgroup_cpu_quota,
        apply: Callable[[int], None] = _set_torch_threads,
        refresh_seconds: float = REFRESH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.setting = setting
        self.registry = registry
        self._omp = omp_threads(environ)
        self._local_world = local_world_size(environ)
        self._cpus, self._quota, self._apply = cpus, quota, apply
        self._clock, self.refresh_seconds = clock, refresh_seconds
        self._lock = threading.Lock()
        self._checked = clock()
        self.plan = self._plan()

    @classmethod
    def start(cls, setting: int | str, environ: Mapping[str, str], **options: Any) -> ThreadBudget:
        """Register this process in the host's registry, plan, apply and log the start-up
        line; the budget to attach to the trainer's logger (`on_event`)."""
        registry = options.pop("registry", None) or SiblingRegistry(registry_dir(environ))
        cpus = options.get("cpus", affinity_cpus)
        if not registry.register(cpus()):
            _LOG.info(  # harmless alone in a container; not a warning on a normal start
                "threads: the sibling registry is off (%s); counting only this process",
                registry.error,
            )
        try:
            budget = cls(setting, environ=environ, registry=registry, **options)
        except BaseException:
            registry.release()
            raise
        weakref.finalize(budget, registry.release)  # also at exit
        budget._apply(budget.plan.threads)
        plan = budget.plan
        if plan.capped:
            _LOG.warning("threads: %s; capped at them", plan.capped)
        _LOG.info(plan.describe(), extra=_event(plan))
        return budget

    @property
    def threads(self) -> int:
        """The current thread count."""
        return self.plan.threads

    def _plan(self) -> ThreadPlan:
        cpus = self._cpus()
        processes = self.registry.count(cpus) if self.registry is not None else 1
        auto = self.setting == "auto" and self._omp is None
        return plan_threads(
            self.setting,
            cpus=cpus,
            quota=self._quota() if auto else None,
            processes=processes,
            local_world=self._local_world,
            omp=self._omp,
        )

    def refresh(self) -> bool:
        """Plan again (``auto`` only); apply and log a changed count. True when it changed."""
        if self.setting != "auto" or self._omp is not None:
            return False
        with self._lock:
            self._checked = self._clock()
            before, plan = self.plan, self._plan()
            self.plan = plan
        if plan.threads == before.threads:
            return False
        self._apply(plan.threads)
        _LOG.info(
            "threads: %d -> %d (%s)", before.threads, plan.threads, plan.reason, extra=_event(plan)
        )
        return True

    def on_event(self, event: str, payload: JSONView) -> None:
        """Logger hook: re-plan when due, adopt the current count on this thread, and leave
        the registry when the run ends."""
        if event == "train_end":
            self.close()
            return
        if self._clock() - self._checked >= self.refresh_seconds:
            self.refresh()
        self._apply(self.plan.threads)

    def close(self) -> None:
        """Leave the sibling registry (idempotent); the thread count stays."""
        if self.registry is not None:
            self.registry.release()


def _event(plan: ThreadPlan) -> JSON:
    """``extra=`` that makes the log record a ``threads`` event under ``logging.format: json``."""
    fields = {
        "threads": plan.threads,
        "source": plan.source,
        "cpus": plan.cpus,
        "quota": plan.quota,
        "processes": plan.processes,
    }
    return {"st_event": "threads", "st_fields": fields}
