"""The HTTP client huggingface_hub uses in this process: one retry layer, bounded calls.

huggingface_hub 2.4.0 retries inside its own calls: ``http_backoff`` (used by listings,
``create_commit``, the LFS endpoints and ``hf_hub_download``'s HEAD/GET) retries 408, 429 and
5xx answers, timeouts and dropped connections up to five times, sleeping 1, 2, 4, 8, 8 s and
logging ``Retrying in ...`` lines; ``hf_hub_download`` resumes broken bodies on its own. There
is no environment knob for it (``HF_HUB_DISABLE_*`` covers progress bars, symlinks, telemetry,
xet, implicit tokens). Nested inside :class:`~speedtronic.diloco.retry.RetryPolicy`, one of our
attempts could take 23 s of SDK sleeps, and ``request_timeout`` bounded nothing.

So the SDK gets a client (``huggingface_hub.utils.set_client_factory``) whose transport turns
every answer and failure the SDK would retry into an exception the SDK does not catch:

* 408, 425, 429 and 5xx answers -> :class:`HubHTTPStatus` (carries ``response.status_code``
  and the ``Retry-After`` header, so ``classify_error`` retries it and honours 429s);
* timeouts -> :class:`HubCallTimeout` (a ``TimeoutError``), dropped connections and broken
  bodies -> :class:`HubConnectionError` (a ``ConnectionError``): both transient for us.

Our policy is then the only retry layer. Inside :func:`hub_call` (every ``HubClient``
primitive) the requests of one call share one deadline: ``request_timeout`` seconds, plus one
second per MiB sent or received, so a large transfer that keeps moving is not cut off while a
stalled or dripping server is. Each request's connect/read/write timeouts are the time left.
Requests outside a call (the SDK's own worker threads, which do not inherit the call's
context) still get no SDK retries, only no shared deadline.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "BYTES_PER_SECOND",
    "HubCallTimeout",
    "HubConnectionError",
    "HubHTTPStatus",
    "hub_call",
    "install_sdk_client",
]

#: Transfer rate a call is always granted on top of ``request_timeout`` (bytes per second).
BYTES_PER_SECOND = 1024 * 1024
_RETRIED_STATUSES = frozenset({408, 425, 429})
_CHUNK = 1024 * 1024
_LOCK = threading.Lock()
_INSTALLED: list[bool] = []


class HubCallTimeout(TimeoutError):
    """A Hub call ran past its deadline (``request_timeout`` plus transfer allowance)."""


class HubConnectionError(ConnectionError):
    """A connection to the Hub failed, was dropped, or ended in the middle of a body."""


class HubHTTPStatus(Exception):
    """The Hub answered with a status worth retrying (408, 425, 429, 5xx).

    ``response`` keeps ``status_code`` and ``headers`` (``Retry-After``) for
    :func:`speedtronic.diloco.retry.classify_error`; the body is not kept.
    """

    def __init__(self, method: str, path: str, status: int, headers: Any) -> None:
        super().__init__(f"HTTP {status} from {method} {path}")
        self.response = _Answer(status, headers)


@dataclasses.dataclass(frozen=True)
class _Answer:
    status_code: int
    headers: Any  # httpx Headers: case-insensitive ``get``


@dataclasses.dataclass
class _Call:
    timeout: float
    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def moved(self, nbytes: int) -> None:
        self.deadline += nbytes / BYTES_PER_SECOND


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "speedtronic_hub_call", default=None
)


@contextlib.contextmanager
def hub_call(timeout: float) -> Iterator[None]:
    """Run one Hub call (any number of SDK requests) under one deadline of ``timeout`` s."""
    token = _CALL.set(_Call(float(timeout), time.monotonic() + float(timeout)))
    try:
        yield
    finally:
        _CALL.reset(token)


def _expired(call: _Call, what: str) -> HubCallTimeout:
    return HubCallTimeout(f"{what}: no answer within the call's {call.timeout:g} s timeout")


def _translate(exc: BaseException, what: str) -> BaseException:
    """An httpx failure as the transient error the SDK does not retry (others unchanged)."""
    import httpx2

    if isinstance(exc, httpx2.TimeoutException):
        return HubCallTimeout(f"{what}: timed out ({type(exc).__name__})")
    if isinstance(exc, (httpx2.NetworkError, httpx2.RemoteProtocolError)):
        return HubConnectionError(f"{what}: connection failed ({type(exc).__name__}: {exc})")
    return exc


def _stream_class() -> type:
    import httpx2

    class _Bounded(httpx2.SyncByteStream):
        """A request or response body that counts towards the call's deadline."""

        def __init__(self, inner: Any, call: _Call | None, what: str, rechunk: bool) -> None:
            self._inner, self._call, self._what, self._rechunk = inner, call, what, rechunk

        def __iter__(self) -> Iterator[bytes]:
            try:
                for chunk in self._inner:
                    pieces = (
                        [chunk[i : i + _CHUNK] for i in range(0, len(chunk), _CHUNK)]
                        if self._rechunk
                        else [chunk]
                    )
                    for piece in pieces:
                        if self._call is not None:
                            if self._call.left() <= 0:
                                raise _expired(self._call, self._what)
                            self._call.moved(len(piece))
                        yield piece
            except Exception as exc:
                translated = _translate(exc, self._what)
                if translated is exc:
                    raise
                raise translated from None

        def close(self) -> None:
            close = getattr(self._inner, "close", None)
            if callable(close):
                close()

    return _Bounded


def _transport_class() -> type:
    import httpx2

    bounded = _stream_class()

    class _OneRetryLayer(httpx2.BaseTransport):
        """Wraps the real transport (see the module docstring)."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def handle_request(self, request: Any) -> Any:
            call = _CALL.get()
            what = f"{request.method} {request.url.path}"
            if call is not None:
                left = call.left()
                if left <= 0:
                    raise _expired(call, what)
                limit = min(call.timeout, left)
                request.extensions["timeout"] = dict.fromkeys(
                    ("connect", "read", "write", "pool"), limit
                )
            request.stream = bounded(request.stream, call, what, rechunk=True)
            try:
                response = self._inner.handle_request(request)
            except Exception as exc:
                translated = _translate(exc, what)
                if translated is exc:
                    raise
                raise translated from None
            status = response.status_code
            if status in _RETRIED_STATUSES or status >= 500:
                headers = response.headers
                response.close()
                raise HubHTTPStatus(request.method, request.url.path, status, headers)
            response.stream = bounded(response.stream, call, what, rechunk=False)
            return response

        def close(self) -> None:
            self._inner.close()

    return _OneRetryLayer


def _client() -> Any:
    """The SDK's default client, every transport (proxies included) wrapped."""
    import httpx2
    from huggingface_hub.utils import _http

    wrap = _transport_class()
    client = httpx2.Client(
        event_hooks={"request": [_http.hf_request_event_hook]}, follow_redirects=True, timeout=None
    )
    client._transport = wrap(client._transport)
    client._mounts = {
        pattern: (wrap(transport) if transport is not None else None)
        for pattern, transport in client._mounts.items()
    }
    return client


def install_sdk_client() -> None:
    """Make huggingface_hub use :func:`_client` (idempotent; a no-op without httpx2)."""
    try:
        import httpx2  # noqa: F401
        from huggingface_hub.utils import _http
    except ImportError:  # older, requests-based SDKs
        return
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED.append(True)
        _http.set_client_factory(_client)
