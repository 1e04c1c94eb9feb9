"""The global lane of a DumbDiLoCo worker: finding a newer global state and fetching it.

:class:`GlobalLane` owns the poll clock (at most one poll per ``poll_interval`` unless a
round boundary forces one), the fetch of a candidate newer than what is installed or already
waiting, the first read at startup, and, in async mode, the ``speedtronic-diloco-poll``
daemon thread fed by a one-slot queue that leaves its result as the single waiting
:class:`~.rounds.GlobalCandidate`. Installing a global is the coordinator's job, on the
training thread. A failed poll is logged and retried at the next poll, never a crash.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from speedtronic.diloco.rounds import GlobalCandidate

__all__ = ["GlobalLane"]


class GlobalLane:
    """Poll the transport for a newer global (in the background or on demand)."""

    def __init__(
        self,
        hub: Any,
        *,
        lock: threading.RLock,
        interval: float,
        installed_step: Callable[[], int],
        say: Callable[[str, str], None],
    ):
        self.hub = hub
        self._lock = lock
        self.interval = interval  # seconds between polls that no boundary forces
        self._installed_step = installed_step  # outer step of the installed global (-1: none)
        self._say = say
        self.last_poll = 0.0  # time.monotonic() of the last poll
        self.queue: queue.Queue[bool] = queue.Queue(maxsize=1)
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.busy = False
        self.candidate: GlobalCandidate | None = None

    def read_first(self, install: Callable[[dict[str, torch.Tensor], int, float], None]) -> bool:
        """Startup: ``install`` a newer remote global; True when the installed one is current.

        A missing global or a failed read is logged; the worker continues from local weights.
        """
        try:
            metadata = self.hub.global_metadata()
            if metadata is None:
                self._say(
                    "warning",
                    "worker could not find global/step_count.json; continuing from local weights",
                )
            elif metadata.outer_step > self._installed_step():
                started = time.perf_counter()
                state = self.hub.read_global(metadata)
                install(state, metadata.outer_step, time.perf_counter() - started)
            else:
                return True
        except Exception as exc:
            self._say("warning", f"initial worker read failed; continuing locally: {exc}")
        return False

    def fetch(self) -> GlobalCandidate | None:
        """Download the remote global if it is newer than the installed or waiting one."""
        started = time.perf_counter()
        metadata = self.hub.global_metadata()
        with self._lock:
            known = max(
                self._installed_step(),
                self.candidate.outer_step if self.candidate else -1,
            )
        if metadata is None or metadata.outer_step <= known:
            return None
        state = self.hub.read_global(metadata)
        return GlobalCandidate(metadata.outer_step, state, time.perf_counter() - started)

    def fetch_due(self, force: bool) -> GlobalCandidate | None:
        """Sync mode: fetch on the calling thread when forced or the interval has passed."""
        now = time.monotonic()
        if not force and now - self.last_poll < self.interval:
            return None
        self.last_poll = now
        try:
            return self.fetch()
        except Exception as exc:
            self._say("warning", f"global poll failed: {exc}")
            return None

    # -- async mode ---------------------------------------------------------------
    def take_candidate(self) -> GlobalCandidate | None:
        """The waiting candidate (the slot is emptied), or None."""
        with self._lock:
            candidate, self.candidate = self.candidate, None
        return candidate

    def schedule(self, force: bool) -> None:
        """Wake the poller when forced or the interval has passed (one poll at a time)."""
        now = time.monotonic()
        if not force and now - self.last_poll < self.interval:
            return
        with self._lock:
            if self.thread is None or self.busy:
                return
            self.last_poll = now
            try:
                self.queue.put_nowait(True)
                self.busy = True
            except queue.Full:
                pass

    def start(self) -> None:
        """Start a fresh poller thread."""
        self.stop_event.clear()
        self.thread = threading.Thread(
            target=self._loop, name="speedtronic-diloco-poll", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            candidate = None
            try:
                candidate = self.fetch()
            except Exception as exc:
                self._say("warning", f"async global poll failed: {exc}")
            with self._lock:
                self.busy = False
                if candidate is not None:
                    self.candidate = candidate
            self.queue.task_done()
