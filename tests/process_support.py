"""Shared by the tests that start processes or threads: wait for a condition with a deadline,
and never leave a started process behind."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable


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
