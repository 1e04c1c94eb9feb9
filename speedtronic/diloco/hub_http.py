"""The HTTP client huggingface_hub uses in this process: one retry layer, bounded calls.

huggingface_hub 2.x retries inside its own calls: ``http_backoff`` (used by listings,
``create_commit``, the LFS endpoints and storage PUTs, and ``hf_hub_download``'s HEAD/GET)
retries 408, 429 and 5xx answers, timeouts and dropped connections up to five times, sleeping
1, 2, 4, 8, 8 s and logging ``Retrying in ...`` lines; ``hf_hub_download`` resumes broken
bodies on its own. There is no environment knob for it. Nested inside
:class:`~speedtronic.diloco.retry.RetryPolicy`, one of our attempts could take 23 s of SDK
sleeps, and ``request_timeout`` bounded nothing.

So the SDK gets a client through its public hook ``huggingface_hub.set_client_factory``: an
``httpx2.Client`` built here whose transports (the direct one and one per proxy from
``HTTP(S)_PROXY``/``ALL_PROXY``, ``NO_PROXY`` honoured) turn every answer and failure the SDK
would retry into an exception the SDK does not catch:

* 408, 425, 429 and 5xx answers -> :class:`HubHTTPStatus` (carries ``response.status_code``
  and the ``Retry-After`` header, so ``classify_error`` retries it and honours 429s);
* timeouts -> :class:`HubCallTimeout` (a ``TimeoutError``), dropped connections and broken
  bodies -> :class:`HubConnectionError` (a ``ConnectionError``): both transient for us.

Our policy is then the only retry layer. Inside :func:`hub_call` (every ``HubClient``
primitive) the requests of one call share one deadline: ``request_timeout`` seconds, plus one
second per MiB sent or received, so a large transfer that keeps moving is not cut off while a
stalled or dripping server is. Each request's connect/read/write timeouts are the time left.
Requests on the SDK's own worker threads (it uploads several LFS files of one commit in a
thread pool, which does not inherit the call's context) get no shared deadline but still each
wait at most the ``request_timeout`` of the latest call for any connect, read or write.

Xet: huggingface_hub moves large files through ``hf_xet`` when it is installed, in Rust, past
this client (no deadline, its own retries). :func:`install_sdk_client` switches it off for the
process (``huggingface_hub.constants.HF_HUB_DISABLE_XET``, the documented
``HF_HUB_DISABLE_XET`` setting, read by the SDK at each call) and logs that once, so large
files take the LFS path through this client (docs/diloco.md, "The Hub's large-file path").

Only public huggingface_hub names are used here (``set_client_factory``, ``constants``,
``errors``); ``tests/test_hub_public_api.py`` fails on a private import anywhere in the package.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import ipaddress
import logging
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
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
_LOG = logging.getLogger("speedtronic.diloco")
#: Per-request timeout (seconds) for requests outside a call: the latest call's timeout.
_OUTSIDE_TIMEOUT = [60.0]


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
    _OUTSIDE_TIMEOUT[0] = float(timeout)
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
            limit = _OUTSIDE_TIMEOUT[0]
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


def _request_hook(request: Any) -> None:
    """What the SDK's own client does before each request, through public names only:
    refuse in offline mode (``HF_HUB_OFFLINE``) and tag the request with an id."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    if constants.is_offline_mode():
        raise OfflineModeIsEnabled(f"Cannot reach {request.url}: offline mode is enabled.")
    if "X-Amzn-Trace-Id" not in request.headers:
        request.headers["X-Amzn-Trace-Id"] = request.headers.get("X-Request-Id") or str(
            uuid.uuid4()
        )


def _proxy_mounts(wrap: Callable[[Any], Any]) -> dict[str, Any]:
    """Transports per URL pattern for the proxies in the environment (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``; ``NO_PROXY`` hosts go direct), each wrapped: httpx only
    reads them itself when no transport is given, and ours is."""
    import httpx2

    proxies = urllib.request.getproxies()
    mounts: dict[str, Any] = {}
    for scheme in ("http", "https", "all"):
        url = proxies.get(scheme)
        if url:
            url = url if "://" in url else f"http://{url}"
            mounts[f"{scheme}://"] = wrap(httpx2.HTTPTransport(proxy=url))
    for host in (h.strip() for h in proxies.get("no", "").split(",")):
        if host == "*":
            return {}
        if not host:
            continue
        if "://" in host:
            mounts[host] = None  # None: the client's own (wrapped, direct) transport
            continue
        try:
            address = ipaddress.ip_address(host.strip("[]"))
            mounts[f"all://[{address}]" if address.version == 6 else f"all://{address}"] = None
        except ValueError:
            mounts[f"all://*{host}" if host.lower() != "localhost" else "all://localhost"] = None
    return mounts


def _client() -> Any:
    """A client like the SDK's default one (redirects followed, no client-wide timeout), with
    every transport wrapped by :func:`_transport_class`."""
    import httpx2

    wrap = _transport_class()
    return httpx2.Client(
        transport=wrap(httpx2.HTTPTransport()),
        mounts=_proxy_mounts(wrap),
        event_hooks={"request": [_request_hook]},
        follow_redirects=True,
        timeout=None,
    )


def _disable_xet() -> None:
    """Large files through the LFS path and this client, never ``hf_xet`` (logged once)."""
    from huggingface_hub import constants

    if not constants.HF_HUB_DISABLE_XET:
        constants.HF_HUB_DISABLE_XET = True
        _LOG.info(
            "huggingface_hub: Xet transfers are off for the Hub store; large files take the "
            "LFS path, bounded by request_timeout and retried by the transport's retry policy"
        )


def install_sdk_client() -> None:
    """Make huggingface_hub use :func:`_client` and the LFS path instead of Xet (idempotent;
    a no-op without an httpx2-based huggingface_hub)."""
    try:
        import httpx2  # noqa: F401
        from huggingface_hub import set_client_factory
    except ImportError:  # no SDK, or one from before its httpx2 client hooks
        return
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED.append(True)
        _disable_xet()
        set_client_factory(_client)
