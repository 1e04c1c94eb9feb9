"""Shared by the tests that start processes or threads: wait for a condition with a deadline,
never leave a started process behind, and give each server a port of its own."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, *, interval: float = 0.2
) -> None:
    """Poll ``predicate`` every ``interval`` seconds; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


STARTED: list[subprocess.Popen] = []
"""Every process a test starts (append it; `TrainProcess` does): after each test the suite's
conftest reaps what is still alive, so no process outlives a failing test."""


def reap(running: list[subprocess.Popen]) -> None:
    """Kill and collect every process in ``running`` that is still alive (emptying it); one
    that leads its own process group (``start_new_session``) is killed with its group."""
    while running:
        proc = running.pop()
        if proc.poll() is None:
            try:
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            except ProcessLookupError:
                pass  # it ended between the poll and the kill
            proc.wait(60)


def run_speedtronic(
    *argv: str, env: dict[str, str], cwd: Path | str | None = None, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """``python -m speedtronic argv`` run to its end in ``cwd`` with ``env``: its exit code
    and its output (stdout, stderr) as text; past ``timeout`` seconds it is killed."""
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a ``python -m speedtronic`` child: this process's without any
    ``SPEEDTRONIC_*`` or ``HF_*`` variable (a developer's settings must not leak in), this tree
    on ``PYTHONPATH``, one OpenMP thread and unbuffered output; then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _ephemeral_low() -> int:
    """Start of the kernel's range for bind(0) and outgoing connections (Linux default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PICKED: set[int] = set()


def free_port() -> int:
    """A TCP port nothing listens on now, never handed out twice in this session.

    Picked below the kernel's ephemeral range: a port from inside it (what bind(0) returns)
    can be taken by any client connection between this probe and the server's own bind, which
    made a metrics server fail with "Address already in use" in CI. The probe binds 0.0.0.0,
    the widest address a test's server binds.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _PICKED:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
        _PICKED.add(port)
        return port
    raise RuntimeError("no free TCP port below the ephemeral range")


class TrainProcess:
    """One ``python -m speedtronic train --config configs/diloco.yaml`` process: its output
    directory ``tmp/<name>``, its event log and its combined output ``tmp/<name>.out``.

    ``sets`` are ``--set`` overrides; the role, node id, exchange ``repo`` and event log are
    added, then ``extra``. Every started process is appended to `STARTED`."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        role: str,
        repo: str,
        sets: list[str],
        env: dict,
        extra: tuple[str, ...] = (),
    ):
        self.tmp, self.name, self.role, self.repo = tmp, name, role, repo
        self.sets, self.env, self.extra = sets, env, extra
        self.dir = tmp / name
        self.jsonl = self.dir / "events.jsonl"
        self.out = tmp / f"{name}.out"
        self.proc: subprocess.Popen | None = None

    def start(self, resume: bool = False, node_id: str | None = None) -> TrainProcess:
        """Start the process (``--resume`` when asked; ``node_id`` defaults to the name)."""
        args = [sys.executable, "-m", "speedtronic", "train"]
        args += ["--config", str(ROOT / "configs/diloco.yaml"), "--output-dir", str(self.dir)]
        sets = [
            *self.sets,
            f"distributed.role={self.role}",
            f"distributed.node_id={node_id or self.name}",
            f"distributed.repo_id={self.repo}",
            f"logging.json_file={self.jsonl}",
            *self.extra,
        ]
        for item in sets:
            args += ["--set", item]
        if resume:
            args.append("--resume")
        with open(self.out, "ab") as out:
            self.proc = subprocess.Popen(
                args, cwd=self.tmp, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        STARTED.append(self.proc)
        return self

    def events(self, name: str) -> list[dict]:
        """The rows of event ``name`` in the process's JSONL log."""
        return jsonl_events(self.jsonl, name)

    def wait(self, timeout: float, *others: TrainProcess) -> int:
        """The exit code; past ``timeout`` the process is killed and the failure shows its
        output and that of ``others``."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name} did not finish:\n{tails(self, *others)}") from None

    def included(self) -> list[tuple[str, int]]:
        """``(node, round)`` of every contribution the (master's) ``outer_step`` events name."""
        out = []
        for row in self.events("outer_step"):
            for item in row["included"]:
                node, label = item.split("/")
                out.append((node, int(label)))
        return out

    def tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the process's output."""
        return self.out.read_text()[-chars:] if self.out.exists() else ""

    def kill(self) -> None:
        """SIGKILL, and wait (a process in an fsync can take a while to die)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)


def jsonl_events(path: Path, name: str) -> list[dict]:
    """The rows of event ``name`` in the JSONL event log ``path`` (none when it does not
    exist yet; a line cut by a SIGKILL is skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("event") == name:
                rows.append(row)
    return rows


def tails(*procs: TrainProcess) -> str:
    """The output tails of ``procs``, each under its name."""
    return "\n".join(f"--- {p.name} ---\n{p.tail()}" for p in procs)
