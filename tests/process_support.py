"""Shared by the tests that start processes or threads: wait for a condition with a deadline,
never leave a started process behind, and give each server a port of its own."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


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


def reap(running: list[subprocess.Popen]) -> None:
    """Kill and collect every process in ``running`` that is still alive (emptying it)."""
    while running:
        proc = running.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


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
