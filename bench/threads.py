"""Threads that fit (issue 29, item 2): ``runtime.threads: auto`` against one thread per process.

Two ratios, each against its peer measured in the same run:

(a) the README's three-process DiLoCo loop (``configs/diloco.yaml``; master, w1, w2 started
    together as independent ``speedtronic train`` processes), shortened to ``--max-steps``
    steps: its wall time with the default (``auto``) over its wall time with
    ``OMP_NUM_THREADS=1`` per process. Target <= 1.15. Also reported: the thread counts each
    process logged (first and last), and how many rounds the master closed with all three nodes.
    ``--old`` adds the behaviour before ``runtime.threads`` (every process takes every core:
    ``runtime.threads`` = this host's CPUs), which is slow (the issue measured 13.8x), to both
    parts.

(b) one process (``configs/smoke.yaml``) in a cgroup limited to ``--cpus`` CPUs, what
    ``docker run --cpus 1`` sets: training time with ``auto`` over training time with
    ``runtime.threads: 1``. Target <= 1.1. The two run at the same time, each in a cgroup of
    its own and with a sibling registry of its own (a container has its own ``/tmp``), so that
    load from elsewhere on the host falls on both alike; the pairs alternate which starts
    first (it trains while the other still imports), and the ratio is the geometric mean over
    the pairs. ``--old`` adds pairs of every core of the host in the same limit (what torch did
    before) against one thread. The cgroups are made directly (root; cgroup v2 ``cpu.max`` or
    v1 ``cpu.cfs_quota_us``); where that is not possible each process is pinned to ``--cpus``
    CPUs with its affinity mask instead, and the JSON says so.

    python bench/threads.py                      # ~1-2 minutes on a 2-core host
    python bench/threads.py --repeats 3          # steadier
    python bench/threads.py --old --repeats 1 --limited-repeats 1   # + the old way (minutes)

Writes ``bench/results/threads.json``. The loops of (a) alternate between the modes so that
load from elsewhere falls on both; (a)'s ratio compares the best run of each mode (the least
disturbed, as ``timeit`` reports), with the ratio of the medians and the CPU seconds the three
processes used beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
THREADS_LINE = re.compile(r"threads: (?:\d+ -> )?(\d+) \((.*)\)")
NODES = ("master", "w1", "w2")


def _env(omp: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "OMP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env


def _thread_lines(text: str) -> list[str]:
    return [m.group(0) for m in THREADS_LINE.finditer(text)]


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("event") == name]


def _children_cpu() -> float:
    """User + system CPU seconds of every child this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def loop_once(work: Path, mode: str, max_steps: int) -> dict[str, Any]:
    """The README loop once: three processes started together; wall seconds until all end."""
    exchange = work / f"exchange-{uuid.uuid4().hex[:8]}"
    omp = "1" if mode == "omp1" else None
    extra = ["--set", f"runtime.threads={os.cpu_count()}"] if mode == "old" else []
    procs = []
    started, used = time.perf_counter(), _children_cpu()
    for node in NODES:
        role = "master" if node == "master" else "worker"
        out = work / f"{mode}-{exchange.name}" / node
        command = [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            str(REPO / "configs" / "diloco.yaml"),
            "--output-dir",
            str(out),
            "--max-steps",
            str(max_steps),
            "--set",
            f"distributed.role={role}",
            "--set",
            f"distributed.node_id={node}",
            "--set",
            f"distributed.repo_id=file://{exchange}",
            *extra,
        ]
        procs.append(
            (
                node,
                out,
                subprocess.Popen(
                    command,
                    cwd=work,
                    env=_env(omp),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )
        )
    logs = {node: proc.communicate(timeout=900)[0] for node, _out, proc in procs}
    seconds, cpu = time.perf_counter() - started, _children_cpu() - used
    codes = {node: proc.returncode for node, _out, proc in procs}
    rounds = _events(procs[0][1] / "events.jsonl", "outer_step")
    full = sum(1 for row in rounds if len(set(row.get("included") or [])) >= len(NODES))
    for node, code in codes.items():
        if code:
            print(f"{mode}: {node} exited {code}:\n{logs[node][-2000:]}", file=sys.stderr)
    return {
        "mode": mode,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu, 2),
        "exit_codes": codes,
        "threads": {node: _thread_lines(text) for node, text in logs.items()},
        "rounds": len(rounds),
        "rounds_with_all_nodes": full,
    }


def _is_cpu_cgroup(base: Path, method: str) -> bool:
    """Whether ``base`` is a mounted cgroup folder whose children get a CPU quota."""
    try:
        if method == "cgroup v1":
            return (base / "cpu.cfs_quota_us").is_file()
        return "cpu" in (base / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


@contextlib.contextmanager
def cpu_limit(cpus: float, slot: int) -> Iterator[tuple[str, Callable[[], None]]]:
    """A way to start a process limited to ``cpus`` CPUs: ``(method, preexec_fn)``.

    A fresh cgroup (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``), one per ``slot``, when
    this process may make one; else the affinity mask (``int(cpus)`` CPUs from CPU ``slot``
    on). The cgroup is removed afterwards.
    """
    period = 100_000
    quota = int(cpus * period)
    name = f"speedtronic-bench-{os.getpid()}-{slot}"
    candidates = [
        (Path("/sys/fs/cgroup"), "cgroup v2", "cpu.max", f"{quota} {period}"),
        (Path("/sys/fs/cgroup/unified"), "cgroup v2", "cpu.max", f"{quota} {period}"),
        (Path("/sys/fs/cgroup/cpu"), "cgroup v1", "cpu.cfs_quota_us", str(quota)),
        (Path("/sys/fs/cgroup/cpu,cpuacct"), "cgroup v1", "cpu.cfs_quota_us", str(quota)),
    ]
    for base, method, control, value in candidates:
        if not _is_cpu_cgroup(base, method):
            continue
        folder = base / name
        try:
            folder.mkdir()
        except OSError:
            continue
        try:
            if method == "cgroup v1":
                (folder / "cpu.cfs_period_us").write_text(str(period))
            (folder / control).write_text(value)
        except OSError:
            folder.rmdir()
            continue
        procs = folder / "cgroup.procs"

        def enter(procs: Path = procs) -> None:
            procs.write_text(str(os.getpid()))

        try:
            yield f"{method} ({base}/<one per arm>/{control} = {value})", enter
        finally:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    folder.rmdir()
                    break
                time.sleep(0.1)
        return
    every = sorted(os.sched_getaffinity(0))
    keep = [every[(slot + i) % len(every)] for i in range(max(1, int(cpus)))]
    yield (
        "affinity mask (no cgroup could be made here)",
        (lambda: os.sched_setaffinity(0, keep)),
    )


def start_limited(work: Path, mode: str, steps: int, enter: Callable[[], None]) -> Any:
    """Start one ``speedtronic train`` of configs/smoke.yaml inside a limit, with a sibling
    registry of its own (a container has its own ``/tmp``); ``(mode, out, process)``."""
    out = work / f"limited-{mode}-{uuid.uuid4().hex[:8]}"
    threads = {"auto": [], "one": ["--set", "runtime.threads=1"]}.get(
        mode, ["--set", f"runtime.threads={os.cpu_count()}"]
    )
    command = [
        sys.executable,
        "-m",
        "speedtronic",
        "train",
        "--config",
        str(REPO / "configs" / "smoke.yaml"),
        "--output-dir",
        str(out),
        "--max-steps",
        str(steps),
        "--set",
        "checkpoint.enabled=false",
        *threads,
    ]
    (out / "run").mkdir(parents=True, mode=0o700)
    env = {**_env(None), "XDG_RUNTIME_DIR": str(out / "run")}
    proc = subprocess.Popen(
        command,
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=enter,
    )
    return mode, out, proc


def finish_limited(mode: str, out: Path, proc: Any) -> dict[str, Any]:
    """Wait for a `start_limited` process; its training seconds and thread line."""
    stdout = proc.communicate(timeout=900)[0]
    if proc.returncode:
        print(f"limited {mode} exited {proc.returncode}:\n{stdout[-2000:]}", file=sys.stderr)
    end = _events(out / "events.jsonl", "train_end")
    return {
        "mode": mode,
        "train_seconds": round(float(end[-1]["elapsed_s"]), 3) if end else None,
        "threads": _thread_lines(stdout),
        "exit_code": proc.returncode,
    }


def limited_pair(
    work: Path, mode: str, steps: int, enters: list[Callable[[], None]], first: bool
) -> dict[str, Any]:
    """``mode`` and ``runtime.threads: 1`` at the same time, each in a limit of its own, so
    that load from elsewhere falls on both alike; the ratio of their training seconds.
    ``first``: ``mode`` starts first (and takes the first limit); the pairs alternate, since
    the one that starts first trains while the other still imports."""
    order = [(mode, "arm"), ("one", "one")] if first else [("one", "one"), (mode, "arm")]
    started = {
        role: start_limited(work, m, steps, e) for (m, role), e in zip(order, enters, strict=True)
    }
    runs = {role: finish_limited(*item) for role, item in started.items()}
    arm, peer = runs["arm"], runs["one"]
    ratio = None
    if arm["train_seconds"] and peer["train_seconds"]:
        ratio = round(arm["train_seconds"] / peer["train_seconds"], 3)
    return {"mode": mode, "first": mode if first else "one", "ratio_vs_one": ratio, **runs}


def _shown(run: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(run), flush=True)
    return run


def _summary(runs: list[dict[str, Any]], key: str, peer: str) -> dict[str, Any]:
    """Best (the least disturbed run, as ``timeit`` reports) and median per mode, and each
    mode's ratio over ``peer``: from the best runs, and (``_median``) from the medians."""
    values: dict[str, list[float]] = {}
    for run in runs:
        if run.get(key) is not None:
            values.setdefault(run["mode"], []).append(float(run[key]))
    best = {mode: min(v) for mode, v in values.items()}
    median = {mode: statistics.median(v) for mode, v in values.items()}
    result: dict[str, Any] = {"best": best, "median": median}
    for mode in best:
        if mode != peer and peer in best:
            result[f"ratio_{mode}_vs_{peer}"] = round(best[mode] / best[peer], 3)
            result[f"ratio_{mode}_vs_{peer}_median"] = round(median[mode] / median[peer], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=60, help="steps of the loop (a)")
    parser.add_argument("--limited-steps", type=int, default=300, help="steps of (b)")
    parser.add_argument("--cpus", type=float, default=1.0, help="the CPU limit of (b)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode of (a)")
    parser.add_argument(
        "--limited-repeats",
        type=int,
        default=4,
        help="pairs per mode of (b), start orders alternating",
    )
    parser.add_argument("--old", action="store_true", help="also every core per process")
    parser.add_argument("--skip", choices=["loop", "limited"], help="leave one part out")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "threads.json"))
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "host_cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "loadavg_start": os.getloadavg(),
    }
    work = Path(tempfile.mkdtemp(prefix="speedtronic-bench-threads-"))
    try:
        if args.skip != "loop":
            modes = ["omp1", "auto", *(["old"] if args.old else [])]
            runs = [
                _shown(loop_once(work, mode, args.max_steps))
                for _ in range(args.repeats)
                for mode in modes
            ]
            result["loop"] = {
                "max_steps": args.max_steps,
                "runs": runs,
                "seconds": _summary(runs, "seconds", "omp1"),
                "cpu_seconds": _summary(runs, "cpu_seconds", "omp1"),
            }
        if args.skip != "limited":
            with contextlib.ExitStack() as stack:
                limits = [stack.enter_context(cpu_limit(args.cpus, slot)) for slot in (0, 1)]
                enters = [enter for _method, enter in limits]
                modes = ["auto", *(["all"] if args.old else [])]
                pairs = [
                    _shown(limited_pair(work, mode, args.limited_steps, enters, i % 2 == 0))
                    for i in range(args.limited_repeats)
                    for mode in modes
                ]
            ratios = {  # geometric mean: the two start orders weigh alike
                f"ratio_{mode}_vs_one": statistics.geometric_mean(
                    p["ratio_vs_one"] for p in pairs if p["mode"] == mode and p["ratio_vs_one"]
                )
                for mode in modes
            }
            result["limited"] = {
                "cpus": args.cpus,
                "method": limits[0][0],
                "steps": args.limited_steps,
                "pairs": pairs,
                **{key: round(value, 3) for key, value in ratios.items()},
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if not isinstance(v, dict)}
    for part in ("loop", "limited"):
        if part in result:
            summary[part] = {k: v for k, v in result[part].items() if k not in ("runs", "pairs")}
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
