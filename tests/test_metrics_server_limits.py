"""The metrics/health server under hostile and sloppy clients (issue 12, row 6).

The server runs in its own process (as under `speedtronic run`), so its threads and file
descriptors can be counted from /proc without the test's own sockets in the figures. Clients
are raw sockets: half-sent requests, a slowloris that trickles one byte at a time, more
connections than the server admits, and requests it must refuse.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from speedtronic.metrics.server import MAX_CONNECTIONS, MAX_REQUEST_BYTES, REQUEST_TIMEOUT

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="counts threads and fds through Linux /proc"
)

# The server as the entrypoint builds it: default limits, a Prometheus registry, a heartbeat.
_SERVER = """
import sys, time
from speedtronic.metrics.prometheus import PrometheusSink
from speedtronic.metrics.server import MetricsServer
sink = PrometheusSink("worker", "w1")
sink.on_event("step", {"step": 1, "loss": 2.5, "tokens": 64, "samples": 1, "lr": 0.001})
server = MetricsServer("127.0.0.1", 0, sink, heartbeat=time.monotonic, ready=lambda: True)
server.start()
print(server.port, flush=True)
sys.stdin.read()
server.stop()
"""

HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\n"  # no blank line


class ServerProcess:
    """A MetricsServer in a child process; its threads and fds read from /proc."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), f"server did not start: {line!r}"
        self.port = int(line)

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    process = ServerProcess()
    try:
        get(process.port, "/metrics")  # warm up: lazy imports, first collection
        yield process
    finally:
        process.close()


def get(port: int, path: str, timeout: float = 3.0) -> int:
    """Status of a plain GET (urllib: what probes and scrapers do)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def exchange(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, half-close, and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:80]
    return int(answer.split(b" ", 2)[1])


def open_slow(port: int, count: int, payload: bytes) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if payload:
            sock.sendall(payload)
        sockets.append(sock)
    return sockets


def wait_dropped(sockets: list[socket.socket], deadline: float) -> dict[socket.socket, float]:
    """{socket: monotonic time the server closed it} for every socket closed before deadline.

    A server may answer 408 before closing; the answer is read and discarded.
    """
    closed: dict[socket.socket, float] = {}
    while len(closed) < len(sockets) and time.monotonic() < deadline:
        pending = [s for s in sockets if s not in closed]
        readable, _, _ = select.select(pending, [], [], 0.1)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                closed[sock] = time.monotonic()
    return closed


def trickle(sockets: list[socket.socket], stop: threading.Event) -> None:
    """Slowloris: one more header byte per socket every 0.5 s, so no read is ever idle long."""
    while not stop.wait(0.5):
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.send(b"X")


def test_half_sent_requests_hold_no_threads_and_are_dropped_within_the_timeout(server):
    base_threads, base_fds = server.threads(), server.fds()
    opened = time.monotonic()
    silent = open_slow(server.port, 20, b"")  # connect, send nothing
    half = open_slow(server.port, 30, HALF_SENT)  # request line and headers, no blank line
    loris = open_slow(server.port, 10, HALF_SENT + b"X-Pad: ")
    slow = silent + half + loris
    stop = threading.Event()
    trickler = threading.Thread(target=trickle, args=(loris, stop), daemon=True)
    trickler.start()
    try:
        time.sleep(0.5)
        held_threads, held_fds = server.threads(), server.fds()
        # Probes and the scrape still answer, promptly, while 60 slow clients are connected.
        for path in ("/healthz", "/readyz", "/metrics"):
            started = time.monotonic()
            assert get(server.port, path) == 200, path
            assert time.monotonic() - started < 2.0, path
        assert held_threads <= base_threads + 2, (base_threads, held_threads)
        assert held_fds <= base_fds + len(slow) + 4, (base_fds, held_fds)

        closed = wait_dropped(slow, opened + REQUEST_TIMEOUT + 3.0)
        dropped_after = [t - opened for t in closed.values()]
        print(
            f"\nslow clients: {len(slow)}; server threads {base_threads} -> {held_threads} "
            f"while held; fds {base_fds} -> {held_fds}; dropped {len(closed)} between "
            f"{min(dropped_after, default=0):.2f} s and {max(dropped_after, default=0):.2f} s "
            f"(timeout {REQUEST_TIMEOUT} s)"
        )
        assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow clients still held"
        assert max(dropped_after) <= REQUEST_TIMEOUT + 2.0
        time.sleep(0.3)
        assert server.threads() <= base_threads + 1
        assert server.fds() <= base_fds + 1, (base_fds, server.fds())
        assert get(server.port, "/healthz") == 200
    finally:
        stop.set()
        trickler.join()
        for sock in slow:
            sock.close()


def test_connections_beyond_the_cap_are_bounded_and_probes_still_get_in(server):
    base_threads, base_fds = server.threads(), server.fds()
    flood = open_slow(server.port, MAX_CONNECTIONS + 40, HALF_SENT)
    try:
        time.sleep(0.5)
        threads, fds = server.threads(), server.fds()
        # A probe arriving now is admitted (the longest-waiting half-sent request gives way).
        for path in ("/healthz", "/readyz", "/metrics"):
            assert get(server.port, path) == 200, path
        print(
            f"\nflood of {len(flood)}: server threads {base_threads} -> {threads}, "
            f"fds {base_fds} -> {fds} (cap {MAX_CONNECTIONS})"
        )
        assert threads <= base_threads + 2, (base_threads, threads)
        assert fds <= base_fds + MAX_CONNECTIONS + 4, (base_fds, fds)
        # Over the cap, the oldest half-sent connections were closed at once.
        evicted = wait_dropped(flood[:40], time.monotonic() + 1.0)
        assert len(evicted) == 40
    finally:
        for sock in flood:
            sock.close()


def test_only_get_and_head_on_the_three_paths(server):
    port = server.port
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"):
        answer = exchange(port, f"{method} /metrics HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status_of(answer) == 405, (method, answer[:80])
        assert b"\r\nAllow: GET, HEAD\r\n" in answer
    head = exchange(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    headers, _, body = head.partition(b"\r\n\r\n")
    assert status_of(head) == 200 and body == b""
    assert int(headers.split(b"Content-Length: ")[1].split(b"\r\n")[0]) > 0
    ok = exchange(port, b"GET /readyz?verbose=1 HTTP/1.0\r\n\r\n")
    assert status_of(ok) == 200 and b"\r\nConnection: close\r\n" in ok
    assert status_of(exchange(port, b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n")) == 404
    assert status_of(exchange(port, b"GET /metrics/../x HTTP/1.1\r\n\r\n")) == 404


def test_oversized_and_malformed_requests_are_refused(server):
    port = server.port
    long_target = b"GET /metrics?" + b"a" * MAX_REQUEST_BYTES + b" HTTP/1.1\r\n\r\n"
    assert status_of(exchange(port, long_target)) == 414
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(MAX_REQUEST_BYTES // 100))
    assert status_of(exchange(port, b"GET /metrics HTTP/1.1\r\n" + many + b"\r\n")) == 431
    body = b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    assert status_of(exchange(port, body)) == 413
    chunked = b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert status_of(exchange(port, chunked)) == 413
    for bad in (b"GARBAGE\r\n\r\n", b"GET /metrics\r\n\r\n", b"GET /m HTTP/1.1\r\nNoColon\r\n\r\n"):
        assert status_of(exchange(port, bad)) == 400, bad
    assert status_of(exchange(port, b"GET /metrics HTTP/2.0\r\n\r\n")) == 505
    assert status_of(exchange(port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")) == 400
    assert get(port, "/healthz") == 200
