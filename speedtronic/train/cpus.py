"""The CPU a process may use, and the torch thread count that fits it (``runtime.threads``).

``auto`` asks the kernel what this process was given, the way torchrun's one-thread default
for several local processes and the JVM's container support do::

    cpus      = len(os.sched_getaffinity(0))           taskset, cpuset, k8s static CPU manager
    quota     = cpu.max (cgroup v2) or cfs_quota_us / cfs_period_us (v1), in CPUs: the
                smallest on the path from this process's cgroup up to its hierarchy's root
                (docker --cpus, compose cpus:, k8s resources.limits.cpu)
    allowed   = min(cpus, ceil(quota))                 no quota: cpus
    processes = max(LOCAL_WORLD_SIZE, training processes on this host that share our CPUs)
    threads   = max(1, allowed // processes)

An explicit ``runtime.threads: N`` wins; ``OMP_NUM_THREADS`` set in the environment wins over
``auto``. ``OMP_NUM_THREADS`` and ``LOCAL_WORLD_SIZE`` are counts of ASCII digits: another value
(``²``, ``-2``, ``many``) is ignored with a warning, and a count above the CPUs in affinity
(``5000``) is capped at them with a warning (`ThreadPlan.capped`). Everything else here is a
pure function of the values or files it is given (``root`` stands for ``/``, so a test passes
a folder of fake ``/proc`` and ``/sys/fs/cgroup`` files); `speedtronic.train.threads` reads
the live values and applies the plan.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ThreadPlan",
    "affinity_cpus",
    "cgroup_cpu_quota",
    "cgroup_dirs",
    "local_world_size",
    "omp_threads",
    "parse_cfs_quota",
    "parse_cpu_max",
    "plan_threads",
]

_ESCAPE = re.compile(r"\\([0-7]{3})")
_LOG = logging.getLogger("speedtronic.threads")


def affinity_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask; all of them where the platform
    has no ``sched_getaffinity``)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return frozenset(getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"<quota> <period>"`` in microseconds,
    ``max`` for no limit); None when unlimited or unreadable."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1: no
    limit); None when unlimited or unreadable."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[int, Path, Path]]:
    """Where this process's CPU controller lives: ``(version, mount point, cgroup folder)``
    for each hierarchy that can hold a CPU quota.

    ``proc_cgroup`` is the text of ``/proc/self/cgroup`` (``0::/path`` for v2,
    ``4:cpu,cpuacct:/path`` for v1), ``mountinfo`` that of ``/proc/self/mountinfo``. The
    cgroup path is taken relative to the mount's root (a container without a cgroup
    namespace sees its own folder mounted as the root), so the folder is always under the
    mount point.
    """
    paths: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
        elif "cpu" in parts[1].split(","):
            paths[1] = parts[2]
    found: list[tuple[int, Path, Path]] = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        kind, options = tail[0], tail[2].split(",")
        version = 2 if kind == "cgroup2" else 1 if kind == "cgroup" and "cpu" in options else 0
        if version not in paths:
            continue
        root, mount = _unescape(fields[3]), Path(_unescape(fields[4]))
        path = paths[version]
        if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
            path = path[len(root) :]
        elif root != "/":
            path = "/"  # a folder outside the mount: its root is the nearest we can see
        folder = mount / path.lstrip("/")
        found.append((version, mount, folder))
    return found


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def _quota_at(version: int, folder: Path) -> float | None:
    if version == 2:
        text = _read(folder / "cpu.max")
        return parse_cpu_max(text) if text is not None else None
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    return parse_cfs_quota(quota, period) if quota is not None and period is not None else None


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``1.5`` = 150 ms per 100 ms), the
    smallest found from its folder up to the hierarchy's root, over cgroup v1 and v2; None
    when no level sets one. ``root`` stands for ``/`` (``proc/self/cgroup``,
    ``proc/self/mountinfo`` and the mount points are read under it)."""
    proc_cgroup = _read(root / "proc/self/cgroup")
    mountinfo = _read(root / "proc/self/mountinfo")
    if proc_cgroup is None or mountinfo is None:
        return None
    quotas: list[float] = []
    for version, mount, folder in cgroup_dirs(proc_cgroup, mountinfo):
        mount, folder = root / mount.relative_to("/"), root / folder.relative_to("/")
        while True:
            quota = _quota_at(version, folder)
            if quota is not None:
                quotas.append(quota)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return min(quotas) if quotas else None


def _env_count(name: str, text: str) -> int | None:
    """``text``, the value of the environment variable ``name``, as a positive count; None
    when empty, and None with a warning when it is not ASCII digits (``²`` is a digit to
    ``str.isdigit`` but not to ``int``) or is 0. More than nine digits read as 10**9 (the plan
    caps it)."""
    text = text.strip()
    if not text:
        return None
    digits = text.lstrip("0")
    if text.isascii() and text.isdigit() and digits:
        return int(digits) if len(digits) <= 9 else 10**9
    _LOG.warning("%s=%r in the environment is not a positive integer; ignored", name, text[:40])
    return None


def omp_threads(environ: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as a positive count (its first level when it lists several), or
    None when unset or not a positive integer (with a warning, see the module)."""
    return _env_count("OMP_NUM_THREADS", environ.get("OMP_NUM_THREADS", "").split(",")[0])


def local_world_size(environ: Mapping[str, str]) -> int:
    """Processes of this node on this host under torchrun (``LOCAL_WORLD_SIZE``; 1 when
    unset or not a positive integer, with a warning for the latter)."""
    return _env_count("LOCAL_WORLD_SIZE", environ.get("LOCAL_WORLD_SIZE", "")) or 1


@dataclass(frozen=True)
class ThreadPlan:
    """The thread count for this process and where it came from.

    ``source`` is ``runtime.threads`` (an explicit count), ``OMP_NUM_THREADS`` or ``auto``;
    ``cpus`` is the size of the affinity mask, ``quota`` the cgroup quota in CPUs (None: no
    quota), ``processes`` the training processes sharing them (this one included); ``capped``
    says which environment count was larger than the CPUs and cut to them (None: none was).
    """

    threads: int
    source: str
    cpus: int
    quota: float | None
    processes: int
    omp: int | None = None
    capped: str | None = None

    @property
    def reason(self) -> str:
        """Where the number came from, in words (the parenthesis of the start-up line)."""
        if self.source == "runtime.threads":
            ignored = f"; OMP_NUM_THREADS={self.omp} not used" if self.omp else ""
            return f"runtime.threads{ignored}"
        if self.source == "OMP_NUM_THREADS":
            cut = (
                f", capped at the {self.cpus} CPUs in affinity" if self.threads != self.omp else ""
            )
            return f"OMP_NUM_THREADS={self.omp} in the environment{cut}"
        quota = "no cgroup quota" if self.quota is None else f"cgroup quota {self.quota:g}"
        cpus = "CPU" if self.cpus == 1 else "CPUs"
        processes = "process" if self.processes == 1 else "processes"
        return (
            f"auto: {self.cpus} {cpus} in affinity, {quota}, "
            f"{self.processes} training {processes} on this host"
        )

    def describe(self) -> str:
        """``threads: 1 (auto: 2 CPUs in affinity, cgroup quota 1, 3 ... on this host)``."""
        return f"threads: {self.threads} ({self.reason})"


def plan_threads(
    setting: int | str,
    *,
    cpus: Iterable[int] | int,
    quota: float | None,
    processes: int = 1,
    local_world: int = 1,
    omp: int | None = None,
) -> ThreadPlan:
    """The thread count for ``runtime.threads`` = ``setting`` (a count or ``"auto"``).

    ``cpus``: the affinity mask (or its size); ``quota``: the cgroup quota in CPUs;
    ``processes``: live training processes on this host that share these CPUs, this one
    included; ``local_world``: torchrun's ``LOCAL_WORLD_SIZE`` (a floor for ``processes``
    while the node's ranks are still starting); ``omp``: ``OMP_NUM_THREADS``. Under ``auto``
    both environment counts are capped at the CPUs in affinity (see `ThreadPlan.capped`).
    """
    count = cpus if isinstance(cpus, int) else len(frozenset(cpus))
    count = max(1, count)
    sharing = max(1, processes, min(local_world, count))
    if setting != "auto":
        return ThreadPlan(int(setting), "runtime.threads", count, quota, sharing, omp)
    over = [
        f"{name}={value}"
        for name, value in (("OMP_NUM_THREADS", omp or 0), ("LOCAL_WORLD_SIZE", local_world))
        if value > count
    ]
    verb = "are" if len(over) > 1 else "is"
    capped = f"{' and '.join(over)} {verb} more than the {count} CPUs in affinity" if over else None
    if omp is not None:
        return ThreadPlan(min(omp, count), "OMP_NUM_THREADS", count, quota, sharing, omp, capped)
    allowed = count if quota is None else min(count, max(1, math.ceil(quota - 1e-9)))
    return ThreadPlan(max(1, allowed // sharing), "auto", count, quota, sharing, omp, capped)
