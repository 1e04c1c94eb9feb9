"""What passes between a DiLoCo node's training thread and its exchange: the contribution it
uploads, the global candidate it merges, the inbox where globals arrive (offered by the local
master or fetched by polling) and the one-at-a-time uploader (see :mod:`speedtronic.diloco.node`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from speedtronic.diloco import tensors as T

__all__ = ["Contribution", "Emit", "GlobalCandidate", "GlobalInbox", "Uploader", "ignore"]

_LOG = logging.getLogger("speedtronic.diloco")


class Emit(Protocol):
    """The one structured reporting channel: ``emit("event_name", field=value, ...)``.

    Event names and fields are a public contract (the Prometheus sink and docs/metrics.md
    read them); log lines go to the ``speedtronic.diloco`` logger instead."""

    def __call__(self, event: str, /, **fields: Any) -> None: ...


def ignore(event: str, /, **fields: Any) -> None:
    """An :class:`Emit` that reports nothing (the default where nobody listens)."""


@dataclasses.dataclass
class Contribution:
    """One upload: a node's pseudo-gradient for round ``round`` (``delta`` None: only the
    ``done`` status is written, because there was nothing left to contribute)."""

    round: int
    base: int
    step: int
    delta: dict[str, torch.Tensor] | None
    final: bool = False
    run_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Checkpointable form (tensors and primitives only)."""
        return {
            "round": self.round,
            "base": self.base,
            "step": self.step,
            "delta": None if self.delta is None else T.cpu_state_dict(self.delta),
            "final": self.final,
            "run_id": self.run_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Contribution:
        """Rebuild a checkpointed contribution."""
        delta = data.get("delta")
        return cls(
            int(data["round"] if "round" in data else data["label"]),  # "label": before 2.2
            int(data["base"]),
            int(data["step"]),
            None if delta is None else T.cpu_state_dict(delta),
            bool(data.get("final", False)),
            str(data.get("run_id", "")),
        )


@dataclasses.dataclass
class GlobalCandidate:
    """A global state waiting for the training thread (``seconds``: download time)."""

    outer_step: int
    state: dict[str, torch.Tensor]
    seconds: float = 0.0
    final: bool = False
    run_id: str = ""


class GlobalInbox:
    """Where new globals arrive: offered by the in-process master, or fetched by polling.

    ``fetch(seen)`` (workers) returns a candidate when the published ``(outer_step, run_id)``
    differs from ``seen``. With ``threaded`` a daemon thread polls every ``interval`` seconds
    (sooner after :meth:`poke`); otherwise :meth:`poll_due` polls on the calling thread.
    """

    def __init__(
        self,
        fetch: Callable[[tuple[int, str]], GlobalCandidate | None] | None,
        *,
        interval: float,
        threaded: bool,
    ):
        self._fetch = fetch
        self.interval = interval
        self.threaded = threaded and fetch is not None
        self._cond = threading.Condition()
        self._candidate: GlobalCandidate | None = None
        self._seen = (-1, "")  # (outer step, run id) of the newest global offered or fetched
        self._last_poll = 0.0
        self._poke = threading.Event()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def offer(self, candidate: GlobalCandidate) -> None:
        """Make ``candidate`` the waiting global (the newest offer wins)."""
        with self._cond:
            self._candidate = candidate
            self._seen = (candidate.outer_step, candidate.run_id)
            self._cond.notify_all()

    def take(self) -> GlobalCandidate | None:
        """The waiting global (the slot is emptied), or None."""
        with self._cond:
            candidate, self._candidate = self._candidate, None
        return candidate

    def waiting_step(self) -> int:
        """Outer step of the waiting global (-1: none)."""
        with self._cond:
            return -1 if self._candidate is None else self._candidate.outer_step

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for an offer (inline polling happens here too)."""
        if not self.threaded and self._fetch is not None:
            self.poll_due()
        with self._cond:
            if self._candidate is None:
                self._cond.wait(timeout)

    def poke(self) -> None:
        """Ask for a poll as soon as possible (a node waits for a global)."""
        self._last_poll = 0.0
        self._poke.set()

    def poll_due(self) -> None:
        """Inline mode: poll when ``interval`` seconds passed since the last poll."""
        if self.threaded or self._fetch is None:
            return
        now = time.monotonic()
        if now - self._last_poll >= self.interval:
            self._last_poll = now
            self._poll()

    def _poll(self) -> None:
        try:
            candidate = self._fetch(self._seen)  # type: ignore[misc]
        except Exception as exc:
            _LOG.warning(f"global poll failed; retrying at the next poll: {exc}")
            return
        if candidate is not None:
            self.offer(candidate)

    def start(self) -> None:
        """Start the poller thread (threaded mode only)."""
        if not self.threaded or (self.thread is not None and self.thread.is_alive()):
            return
        self._stop.clear()
        self.thread = threading.Thread(
            target=self._loop, name="speedtronic-diloco-poll", daemon=True
        )
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the poller thread (bounded join)."""
        self._stop.set()
        self._poke.set()
        thread, self.thread = self.thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._poke.wait(self.interval)
            self._poke.clear()


class Uploader:
    """One upload at a time: on a daemon thread (``threaded``) or on the calling thread."""

    def __init__(self, send: Callable[[Contribution], Any], *, threaded: bool):
        self._send = send
        self.threaded = threaded
        self._queue: queue.Queue[Contribution] = queue.Queue()
        self._cond = threading.Condition()
        self.pending: Contribution | None = None  # submitted, not finished
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def submit(self, job: Contribution) -> None:
        """Send ``job`` (after the previous one finished)."""
        self.drain()
        with self._cond:
            self.pending = job
        if self.threaded:
            self._ensure_thread()
            self._queue.put(job)
        else:
            self._run(job)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no upload is in flight; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.pending is not None and (self.thread is not None or not self.threaded):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _run(self, job: Contribution) -> None:
        try:
            self._send(job)
        finally:
            with self._cond:
                if self.pending is job:
                    self.pending = None
                self._cond.notify_all()

    def _ensure_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self._stop.clear()
            self.thread = threading.Thread(
                target=self._loop, name="speedtronic-diloco-upload", daemon=True
            )
            self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set() or not self._queue.empty():
            try:
                job = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._run(job)

    def stop(self, timeout: float) -> bool:
        """Let the job in flight finish (bounded); True when nothing is left pending."""
        finished = self.drain(timeout)
        self._stop.set()
        thread, self.thread = self.thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(0.5)
        return finished
