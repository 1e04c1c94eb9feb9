"""Metrics and health HTTP server: ``/metrics``, ``/healthz`` and ``/readyz`` on one port.

One daemon thread runs a bounded HTTP/1.1 server (`speedtronic.metrics.httpd`):

* ``/metrics`` — the registry in Prometheus text format (prometheus_client's exposition).
* ``/healthz`` — 200 while the training loop's heartbeat is fresh; 503 once no heartbeat was
  seen for more than ``stall_seconds``. Before the first heartbeat the server's start time
  counts as one, so model building and start-up have the same grace period.
* ``/readyz`` — 200 once ``ready()`` returns true (the entrypoint wires: config loaded, model
  built, and for a worker the first global state known); 503 before.

The port is unauthenticated and often reachable from a whole network, so clients get bounded
resources: at most `MAX_CONNECTIONS` open connections served by one thread (when full, the
longest-waiting unfinished request gives way to the newcomer, so probes get in during a flood
of slow clients), `REQUEST_TIMEOUT` seconds to send a request and again to take the answer,
`MAX_REQUEST_BYTES` of request line and headers, GET and HEAD only, no request body.

The socket is bound in the constructor, so a port already in use fails before any training
starts (`MetricsPortInUse`, a `ConfigError` naming ``metrics.port``).

`StallWatchdog` applies the same rule to the process itself: once armed (the training loop
runs), a heartbeat older than ``stall_seconds`` calls ``on_stall``. The entrypoint ends the
process there, so ``restart: on-failure`` and Kubernetes restart a stalled loop even where
nothing acts on ``/healthz``.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from speedtronic.background import Loop
from speedtronic.config import ConfigError
from speedtronic.json_types import JSON
from speedtronic.metrics.httpd import BoundedHTTPServer, Response, json_response

if TYPE_CHECKING:
    from speedtronic.metrics.prometheus import PrometheusSink

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_REQUEST_BYTES",
    "REQUEST_TIMEOUT",
    "MetricsPortInUse",
    "MetricsServer",
    "StallWatchdog",
    "heartbeat_age",
]

MAX_CONNECTIONS = 64  # open connections at once (probes and scrapes need a handful)
REQUEST_TIMEOUT = 5.0  # seconds to send a request, and again to take the answer
MAX_REQUEST_BYTES = 8192  # request line + headers; a probe or a scrape sends a few hundred


class MetricsPortInUse(ConfigError):
    """The configured ``metrics.host:metrics.port`` cannot be bound (already in use)."""


def heartbeat_age(last: float | None, started: float, now: float) -> float:
    """Seconds since the last heartbeat (since ``started`` before the first one)."""
    return max(now - (last if last is not None else started), 0.0)


class MetricsServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` from one background thread.

    Args:
        host: interface to bind (``0.0.0.0`` in containers, where probes arrive on the pod's
            or container's address).
        port: TCP port; 0 picks a free one (see `port`).
        registry: a `CollectorRegistry`, or an object with a ``registry`` attribute (a
            `PrometheusSink`).
        heartbeat: returns the monotonic time (seconds) of the last training-loop heartbeat,
            or None when there was none yet.
        ready: returns whether the process is ready for traffic/probes.
        stall_seconds: heartbeat age above which ``/healthz`` answers 503.
        clock: monotonic clock (seconds), injectable for tests.
        max_connections: open connections at most (see the module docstring).
        request_timeout: seconds a client has to send its request and to take the answer.
        max_request_bytes: request line plus headers at most, in bytes.

    Raises:
        MetricsPortInUse: when the address is already in use.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry | PrometheusSink,
        *,
        heartbeat: Callable[[], float | None] | None = None,
        ready: Callable[[], bool] | None = None,
        stall_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self.registry = registry if isinstance(registry, CollectorRegistry) else registry.registry
        self.heartbeat = heartbeat or (lambda: None)
        self.ready = ready or (lambda: True)
        self.stall_seconds = float(stall_seconds)
        self._clock = clock
        self._started = clock()
        routes = {"/metrics": self._metrics, "/healthz": self._healthz, "/readyz": self._readyz}
        try:
            self._httpd = BoundedHTTPServer(
                host,
                port,
                routes,
                max_connections=max_connections,
                timeout=request_timeout,
                max_request_bytes=max_request_bytes,
            )
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                raise MetricsPortInUse(
                    f"metrics.port: cannot listen on {host}:{port} ({exc.strerror}); "
                    "choose another port (SPEEDTRONIC_METRICS__PORT) or free this one"
                ) from None
            raise

    @property
    def host(self) -> str:
        """The bound interface address."""
        return self._httpd.server_address[0]

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when 0 was requested)."""
        return self._httpd.server_address[1]

    @property
    def limits(self) -> dict[str, float]:
        """The connection limits in force (for the startup log)."""
        return {
            "max_connections": self._httpd.max_connections,
            "request_timeout_seconds": self._httpd.timeout,
            "max_request_bytes": self._httpd.max_request_bytes,
        }

    def _metrics(self) -> Response:
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    def _healthz(self) -> Response:
        healthy, detail = self.health()
        return json_response(200 if healthy else 503, detail)

    def _readyz(self) -> Response:
        ready = self.is_ready()
        return json_response(200 if ready else 503, {"ready": ready})

    def health(self) -> tuple[bool, JSON]:
        """``(healthy, detail)``: healthy while the heartbeat is younger than stall_seconds."""
        age = heartbeat_age(self.heartbeat(), self._started, self._clock())
        healthy = age <= self.stall_seconds
        return healthy, {
            "healthy": healthy,
            "heartbeat_age_seconds": round(age, 3),
            "stall_seconds": self.stall_seconds,
        }

    def is_ready(self) -> bool:
        """Whether ``/readyz`` answers 200; a failing readiness callback counts as not ready."""
        try:
            return bool(self.ready())
        except Exception:
            return False

    def start(self) -> MetricsServer:
        """Start serving in a daemon thread; returns self."""
        self._httpd.start()
        return self

    def stop(self) -> None:
        """Stop serving, drop open connections and close the socket (idempotent)."""
        self._httpd.stop()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StallWatchdog:
    """Call ``on_stall(age)`` once when an armed process's heartbeat gets older than
    ``stall_seconds`` (the threshold ``/healthz`` uses).

    Args:
        heartbeat: monotonic time (seconds) of the last heartbeat, or None.
        stall_seconds: allowed heartbeat age in seconds.
        on_stall: called from the watchdog thread with the age in seconds; the entrypoint
            logs and ends the process there.
        armed: whether stalls count right now (the entrypoint: the training loop runs and no
            graceful stop is in progress).
        clock: monotonic clock (seconds), injectable for tests.
        interval: seconds between checks (default: ``stall_seconds / 10``, at most 5 s).
    """

    def __init__(
        self,
        heartbeat: Callable[[], float | None],
        stall_seconds: float,
        on_stall: Callable[[float], None],
        *,
        armed: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        interval: float | None = None,
    ) -> None:
        self.heartbeat, self.on_stall, self.armed = heartbeat, on_stall, armed
        self.stall_seconds = float(stall_seconds)
        self.interval = interval if interval is not None else min(self.stall_seconds / 10, 5.0)
        self._clock = clock
        self._started = clock()
        self._loop = Loop("speedtronic-stall-watchdog", self.check, self.interval, wait_first=True)
        self.fired = False

    def check(self) -> bool:
        """One check: True (after calling ``on_stall``) when the armed heartbeat is stale."""
        if self.fired or not self.armed():
            return False
        age = heartbeat_age(self.heartbeat(), self._started, self._clock())
        if age <= self.stall_seconds:
            return False
        self.fired = True
        self.on_stall(age)
        return True

    def start(self) -> StallWatchdog:
        """Check every ``interval`` seconds in a daemon thread; returns self."""
        self._loop.start()
        return self

    def stop(self) -> None:
        """Stop checking (idempotent)."""
        self._loop.stop(timeout=5.0)
