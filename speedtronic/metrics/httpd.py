"""A bounded HTTP/1.1 server for a few read-only endpoints (the metrics and health port).

Whatever clients do, the server holds:

* **one thread**: an asyncio loop serves every connection; a slow or stuck client costs a
  file descriptor for at most ``timeout`` seconds, never a thread;
* **at most** ``max_connections`` **open connections**: when all are taken, the connection
  that has waited longest for its request is closed to admit the new one, so a flood of slow
  clients cannot lock probes out; only when every connection is already being answered is the
  new one refused (503);
* **deadlines**: the request line and headers must arrive within ``timeout`` seconds of the
  connection (a total, so trickling one byte at a time does not extend it; 408 after), and
  the response must be taken within ``timeout`` seconds;
* **sizes**: at most ``max_request_bytes`` of request line and headers (414 / 431), at most
  `MAX_HEADER_LINES` header lines, no request body (413);
* **methods**: GET and HEAD (405 with ``Allow`` otherwise) on the routed paths (404
  otherwise), one request per connection (``Connection: close``).

Routes are plain functions called on the loop thread; they must be quick (the endpoints read
a few numbers and render the Prometheus registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import socket
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus

__all__ = ["MAX_HEADER_LINES", "BoundedHTTPServer", "Response", "json_response"]

MAX_HEADER_LINES = 64
_VERSION = re.compile(r"HTTP/(\d)\.(\d)")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token (methods, header names)


@dataclasses.dataclass(frozen=True)
class Response:
    """One HTTP answer: status code, body bytes, content type and extra headers."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


def json_response(status: int, payload: object, **headers: str) -> Response:
    """A JSON `Response` (one line, newline-terminated)."""
    body = (json.dumps(payload) + "\n").encode()
    return Response(status, body, "application/json", tuple(headers.items()))


class _Refused(Exception):
    """A request the server answers with an error status (and then closes)."""

    def __init__(self, status: int, message: str, **headers: str) -> None:
        super().__init__(message)
        self.response = json_response(status, {"error": message}, **headers)


class _Gone(Exception):
    """The client closed or reset the connection before its request was complete."""


@dataclasses.dataclass(eq=False)
class _Connection:
    writer: asyncio.StreamWriter
    answering: bool = False

    def abort(self) -> None:
        self.writer.transport.abort()


class BoundedHTTPServer:
    """Serve ``routes`` (path -> function returning a `Response`) with the bounds above.

    The listening socket is bound in the constructor, so a bad address or a port in use
    raises `OSError` before `start`.

    Args:
        host: interface to bind; an address containing ``:`` is IPv6.
        port: TCP port; 0 picks a free one (see `server_address`).
        routes: exact paths (query strings are ignored) and their handlers.
        max_connections: open connections at most.
        timeout: seconds a client has to send its request, and again to take the response.
        max_request_bytes: bytes of request line plus headers at most.
    """

    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[str, Callable[[], Response]],
        *,
        max_connections: int,
        timeout: float,
        max_request_bytes: int,
    ) -> None:
        if max_connections < 1 or timeout <= 0 or max_request_bytes < 64:
            raise ValueError("max_connections >= 1, timeout > 0, max_request_bytes >= 64")
        self.routes = dict(routes)
        self.max_connections = int(max_connections)
        self.timeout = float(timeout)
        self.max_request_bytes = int(max_request_bytes)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, int(port)), family=family, backlog=128)
        self._connections: dict[_Connection, None] = {}  # insertion order = age
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._running = threading.Event()

    @property
    def server_address(self) -> tuple[str, int]:
        """The bound ``(address, port)``."""
        address = self._sock.getsockname()
        return str(address[0]), int(address[1])

    def start(self) -> None:
        """Serve from a daemon thread (``speedtronic-metrics``); returns once it accepts."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(),), name="speedtronic-metrics", daemon=True
        )
        self._thread.start()
        self._running.wait(timeout=10.0)

    def stop(self) -> None:
        """Close every connection and the listening socket (idempotent)."""
        loop, stopping, thread = self._loop, self._stopping, self._thread
        if thread is not None and loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stopping.set)
            thread.join(timeout=5.0)
        self._thread = None
        self._sock.close()

    # -- the loop ------------------------------------------------------------------------
    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        try:
            server = await asyncio.start_server(
                self._accept, sock=self._sock, limit=self.max_request_bytes
            )
        finally:
            self._running.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for connection in list(self._connections):
                connection.abort()
            await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        if len(self._connections) >= self.max_connections:
            waiting = next((c for c in self._connections if not c.answering), None)
            if waiting is None:
                self._refuse(writer)
                return
            del self._connections[waiting]
            waiting.abort()
        self._connections[connection] = None
        try:
            await self._serve(connection, reader)
        except (OSError, _Gone, asyncio.TimeoutError):
            connection.abort()
        finally:
            self._connections.pop(connection, None)

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """503 without waiting: written at once into the fresh socket's buffer, then closed."""
        writer.write(_encode(json_response(503, {"error": "too many connections"}), False))
        if writer.transport.get_write_buffer_size():
            writer.transport.abort()
        else:
            writer.close()

    async def _serve(self, connection: _Connection, reader: asyncio.StreamReader) -> None:
        head_only = False
        try:
            lines = await asyncio.wait_for(self._read_head(reader), self.timeout)
            method, path = self._parse(lines)
            head_only = method == "HEAD"
            response = self._route(path)
        except asyncio.TimeoutError:
            response = json_response(408, {"error": "request not received in time"})
        except _Refused as refused:
            response = refused.response
        connection.answering = True
        writer = connection.writer
        writer.transport.set_write_buffer_limits(high=0)
        writer.write(_encode(response, head_only))
        await asyncio.wait_for(writer.drain(), self.timeout)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), self.timeout)

    async def _read_head(self, reader: asyncio.StreamReader) -> list[bytes]:
        """Request line and header lines, without line ends, up to the blank line."""
        lines: list[bytes] = []
        total = 0
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # one line longer than the stream's limit
                raise _Refused(*_too_large(lines)) from None
            except ConnectionError as exc:
                raise _Gone() from exc
            if not line.endswith(b"\n"):
                raise _Gone()  # end of stream before the head was complete
            total += len(line)
            if total > self.max_request_bytes:
                raise _Refused(*_too_large(lines))
            line = line.rstrip(b"\r\n")
            if not line:
                if lines:
                    return lines
                continue  # RFC 9112 2.2: ignore empty lines before the request line
            lines.append(line)
            if len(lines) > MAX_HEADER_LINES + 1:
                raise _Refused(431, f"more than {MAX_HEADER_LINES} header lines")

    def _parse(self, lines: list[bytes]) -> tuple[str, str]:
        """(method, path) of a well-formed GET/HEAD without a body; `_Refused` otherwise."""
        parts = lines[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]:
            raise _Refused(400, "malformed request line")
        method, target, version = parts
        match = _VERSION.fullmatch(version)
        if match is None:
            raise _Refused(400, "malformed HTTP version")
        if match.group(1) != "1":
            raise _Refused(505, "only HTTP/1.0 and HTTP/1.1 are served")
        headers: dict[str, str] = {}
        for raw in lines[1:]:
            name, colon, value = raw.decode("latin-1").partition(":")
            if not colon or not _TOKEN.fullmatch(name):
                raise _Refused(400, "malformed header line")
            headers[name.lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            raise _Refused(405, "only GET and HEAD are served", Allow="GET, HEAD")
        length = headers.get("content-length", "0")
        if not length.isdigit():
            raise _Refused(400, "malformed Content-Length")
        if int(length) or "transfer-encoding" in headers:
            raise _Refused(413, "GET and HEAD requests take no body")
        if target.startswith(("http://", "https://")):  # absolute form: keep the path
            target = "/" + target.split("/", 3)[3] if target.count("/") >= 3 else "/"
        return method, target.split("?", 1)[0]

    def _route(self, path: str) -> Response:
        handler = self.routes.get(path)
        if handler is None:
            return json_response(404, {"error": "not found", "paths": sorted(self.routes)})
        try:
            return handler()
        except Exception:
            return json_response(500, {"error": "internal error"})


def _too_large(lines: list[bytes]) -> tuple[int, str]:
    if not lines:
        return 414, "request line too long"
    return 431, "request headers too large"


def _encode(response: Response, head_only: bool) -> bytes:
    """Status line, headers and (unless HEAD) the body, as bytes."""
    reason = HTTPStatus(response.status).phrase
    headers = [
        ("Content-Type", response.content_type),
        ("Content-Length", str(len(response.body))),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        ("Connection", "close"),
        *response.headers,
    ]
    head = f"HTTP/1.1 {response.status} {reason}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
    return head.encode("latin-1") + (b"" if head_only else response.body)
