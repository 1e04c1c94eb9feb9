"""Metrics and health HTTP server: ``/metrics``, ``/healthz`` and ``/readyz`` on one port.

One daemon thread runs a small `ThreadingHTTPServer`:

* ``/metrics`` — the registry in Prometheus text format (prometheus_client's exposition).
* ``/healthz`` — 200 while the training loop's heartbeat is fresh; 503 once no heartbeat was
  seen for more than ``stall_seconds``. Before the first heartbeat the server's start time
  counts as one, so model building and start-up have the same grace period.
* ``/readyz`` — 200 once ``ready()`` returns true (the entrypoint wires: config loaded, model
  built, and for a worker the first global state known); 503 before.

The socket is bound in the constructor, so a port already in use fails before any training
starts (`MetricsPortInUse`, a `ConfigError` naming ``metrics.port``).

`StallWatchdog` applies the same rule to the process itself: once armed (the training loop
runs), a heartbeat older than ``stall_seconds`` calls ``on_stall``. The entrypoint ends the
process there, so ``restart: on-failure`` and Kubernetes restart a stalled loop even where
nothing acts on ``/healthz``.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from speedtronic.config import ConfigError

__all__ = ["MetricsPortInUse", "MetricsServer", "StallWatchdog", "heartbeat_age"]


class MetricsPortInUse(ConfigError):
    """The configured ``metrics.host:metrics.port`` cannot be bound (already in use)."""


def heartbeat_age(last: float | None, started: float, now: float) -> float:
    """Seconds since the last heartbeat (since ``started`` before the first one)."""
    return max(now - (last if last is not None else started), 0.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: MetricsServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(owner.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            healthy, detail = owner.health()
            self._send_json(200 if healthy else 503, detail)
        elif path == "/readyz":
            ready = owner.is_ready()
            self._send_json(200 if ready else 503, {"ready": ready})
        else:
            self._send_json(
                404, {"error": "not found", "paths": ["/metrics", "/healthz", "/readyz"]}
            )

    def _send_json(self, code: int, body: dict[str, Any]) -> None:
        self._send(code, (json.dumps(body) + "\n").encode(), "application/json")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Silence per-request access logs (probes hit these endpoints every few seconds)."""


class MetricsServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` from one background thread.

    Args:
        host: interface to bind (``0.0.0.0`` in containers).
        port: TCP port; 0 picks a free one (see `port`).
        registry: a `CollectorRegistry`, or an object with a ``registry`` attribute (a
            `PrometheusSink`).
        heartbeat: returns the monotonic time (seconds) of the last training-loop heartbeat,
            or None when there was none yet.
        ready: returns whether the process is ready for traffic/probes.
        stall_seconds: heartbeat age above which ``/healthz`` answers 503.
        clock: monotonic clock (seconds), injectable for tests.

    Raises:
        MetricsPortInUse: when the address is already in use.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: Any,
        *,
        heartbeat: Callable[[], float | None] | None = None,
        ready: Callable[[], bool] | None = None,
        stall_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry: CollectorRegistry = getattr(registry, "registry", registry)
        self.heartbeat = heartbeat or (lambda: None)
        self.ready = ready or (lambda: True)
        self.stall_seconds = float(stall_seconds)
        self._clock = clock
        self._started = clock()
        self._thread: threading.Thread | None = None
        try:
            self._httpd = _Server((host, int(port)), _Handler, bind_and_activate=True)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                raise MetricsPortInUse(
                    f"metrics.port: cannot listen on {host}:{port} ({exc.strerror}); "
                    "choose another port (SPEEDTRONIC_METRICS__PORT) or free this one"
                ) from None
            raise
        self._httpd.owner = self

    @property
    def host(self) -> str:
        """The bound interface address."""
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when 0 was requested)."""
        return int(self._httpd.server_address[1])

    def health(self) -> tuple[bool, dict[str, Any]]:
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
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="speedtronic-metrics",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5.0)
            self._thread = None
        self._httpd.server_close()

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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="speedtronic-stall-watchdog", daemon=True
            )
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.check():
                return

    def stop(self) -> None:
        """Stop checking (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None
