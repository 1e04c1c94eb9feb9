"""The two ways the package waits: a bounded poll on the calling thread, and a daemon loop.

:func:`wait_for` is the one wait helper: it asks ``ready()`` until it answers something truthy,
the deadline passes or a stop event is set, sleeping between asks without overshooting the
deadline. :class:`Loop` is the one worker-thread helper: a named daemon thread that calls
``tick()`` every ``interval`` seconds (or sooner, when woken) until stopped or until ``tick``
returns True; ``stop`` is idempotent, bounded and safe to call from the loop's own thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Loop", "wait_for"]

T = TypeVar("T")


def wait_for(
    ready: Callable[[], T],
    *,
    timeout: float | None,
    interval: float | Callable[[int], float],
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> T | None:
    """Call ``ready()`` until it returns a truthy value (returned), ``timeout`` seconds pass or
    ``stop`` is set (None). ``interval`` is the pause between calls, or a function of the attempt
    number (1, 2, ...) for a growing pause. ``ready`` is always called at least once."""
    deadline = None if timeout is None else clock() + timeout
    attempt = 0
    while True:
        value = ready()
        if value:
            return value
        attempt += 1
        pause = interval(attempt) if callable(interval) else interval
        if deadline is not None:
            remaining = deadline - clock()
            if remaining <= 0:
                return None
            pause = min(pause, remaining)
        if stop is not None:
            if stop.wait(pause):
                return None
        elif pause > 0:
            time.sleep(pause)


class Loop:
    """A named daemon thread calling ``tick()`` every ``interval`` seconds until :meth:`stop`.

    ``tick`` returns True when the loop is done (the thread ends). With ``wait_first`` the first
    call comes after one interval (a lease renewal, a watchdog); without it, at once (a poller).
    :meth:`wake` makes the next call happen now. An exception from ``tick`` ends the loop, so a
    tick that must survive failures catches them itself."""

    def __init__(
        self,
        name: str,
        tick: Callable[[], bool | None],
        interval: float | Callable[[], float],
        *,
        wait_first: bool = False,
    ) -> None:
        self.name = name
        self._tick = tick
        self._interval = interval
        self._wait_first = wait_first
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """True while the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called (until the next :meth:`start`)."""
        return self._stop.is_set()

    def start(self) -> None:
        """Start the thread unless it already runs."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Make the next ``tick`` happen without waiting out the interval."""
        self._wake.set()

    def pause(self) -> None:
        """Wait one interval, or less when woken or stopped (the loop's own sleep)."""
        interval = self._interval() if callable(self._interval) else self._interval
        self._wake.wait(interval)
        self._wake.clear()

    def _run(self) -> None:
        if self._wait_first:
            self.pause()
        while not self._stop.is_set():
            if self._tick():
                return
            if self._stop.is_set():
                return
            self.pause()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to end and join it for at most ``timeout`` seconds (idempotent; from
        the loop's own thread it only asks)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
