"""One process's uplink to the Hub, shared by its uploads: a background upload gives way.

The master sends a new run's global 0 (12 MB of fp32 weights for the link bench's model) after
the record that names it, on a thread of its own, while the first rounds publish their updates
(``exchange.WeightsUpload``). Over a slow link the two uploads shared the uplink as TCP shares
it: the long one, its window already open, took most of it, and global 1's update (1 MB) took
5 s instead of 0.9, which both nodes of the link bench waited for. Here a background upload
(:meth:`~speedtronic.diloco.exchange.Store.commit` with ``background=True``) gives way:

- :data:`UPLINK` counts the foreground request bodies being sent (an LFS upload: a request
  body over :data:`SMALL_BODY`; records and commits are small and do not count), from their
  first byte until the Hub's answer, i.e. until the Hub has them all;
- a background request body waits before each piece it sends while one is
  (:meth:`Uplink.give_way`), for at most half of its call's timeout in all (so a link that
  the rounds fill never starves it past its deadline; the time it waited does not count
  against that deadline);
- what the background upload handed to the kernel before it stopped (its socket's send
  buffer) still goes out beside the foreground one: a fraction of a second at 10 Mbit/s.

A volume (``DirectoryStore``) has no uplink: its commits write at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx2

#: A foreground request body larger than this (bytes) holds the background uploads.
SMALL_BODY = 64 * 1024


class Uplink:
    """The foreground uploads of this process, which background uploads give way to."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sending = 0

    @property
    def busy(self) -> bool:
        """Whether a foreground body is being sent now."""
        with self._cond:
            return self._sending > 0

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """A foreground body is being sent for the ``with`` block."""
        with self._cond:
            self._sending += 1
        try:
            yield
        finally:
            with self._cond:
                self._sending -= 1
                self._cond.notify_all()

    def give_way(self, limit: float) -> float:
        """Wait while a foreground body is being sent, at most ``limit`` s; the seconds waited."""
        if limit <= 0:
            return 0.0
        begun = time.monotonic()
        with self._cond:
            self._cond.wait_for(lambda: self._sending == 0, timeout=limit)
        return time.monotonic() - begun


#: The uplink of this process (every Hub client of it shares the link).
UPLINK = Uplink()


def large_body(request: httpx2.Request) -> bool:
    """Whether ``request`` sends a body over :data:`SMALL_BODY` (or one of unknown length)."""
    if request.method not in ("PUT", "POST", "PATCH"):
        return False
    length = request.headers.get("content-length")
    if length is None:
        return "chunked" in request.headers.get("transfer-encoding", "")
    return length.isdigit() and int(length) > SMALL_BODY
