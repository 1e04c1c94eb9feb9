"""Calls to a remote store that may fail: the errors they end in, and the one retry policy.

Every failure of a call (the Hub SDK's, HTTP, the filesystem of a shared volume) becomes a
:class:`TransportError` in one place (:func:`classify_error`, :meth:`RetryPolicy.run`):
``transient`` ones (outages, 5xx, 429, timeouts, dropped connections) are retried with
exponential backoff, ``not_found`` and ``permanent`` ones (auth, bad request, programming
errors) are not, a ``damaged`` file (:class:`DamagedFile`) is retried, then ``permanent``.
Messages never carry the token (:func:`~speedtronic.config.redaction.scrub`). Used by the
DiLoCo stores (:mod:`speedtronic.diloco.exchange`) and by the model import and ``push``
(``init_from``, :mod:`speedtronic.publish`), so neither reaches into the other for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from speedtronic.config.redaction import scrub

if TYPE_CHECKING:
    from speedtronic.config.ops_sections import DistributedConfig

__all__ = [
    "AccessRefused",
    "DamagedFile",
    "ErrorInfo",
    "HubUnavailable",
    "RemoteNotFound",
    "RetryPolicy",
    "TransportError",
    "classify_error",
    "retry_policy_from_config",
]

R = TypeVar("R")


class TransportError(RuntimeError):
    """A store operation failed (after retries when the error was transient).

    ``kind`` is ``transient`` (outage, 5xx, 429, timeout), ``not_found``, ``permanent``
    (auth, bad request, unsupported) or ``damaged`` (:class:`DamagedFile`, while it is still
    retried), by default the class's; ``status`` is the HTTP status when there was one.
    """

    default_kind = "transient"

    def __init__(self, message: str, *, kind: str | None = None, status: int | None = None):
        super().__init__(message)
        self.kind = kind or self.default_kind
        self.status = status


class AccessRefused(TransportError):
    """The exchange refuses this process: the Hub answered 401 or 403, or 404 "Repository
    not found" for our own repository (a token that cannot see it). Always permanent; the
    message names the repository and what to check, never the token."""

    default_kind = "permanent"


class DamagedFile(TransportError):
    """A file the store holds but cannot hand over whole and intact: the bytes read disagree
    with the size or hash of the store's own record of them (the Hub's LFS pointer), or the
    body is cut short. Retried like an outage (a read may recover), then ``permanent``: a
    reader refuses it as any bad file (the master counts it ``corrupt`` and prunes it)."""

    default_kind = "damaged"


class HubUnavailable(TransportError):
    """Retries exhausted: the store is unreachable for now."""


class RemoteNotFound(TransportError):
    """The remote file or repository does not exist."""

    default_kind = "not_found"

    def __init__(self, message: str, *, status: int | None = 404):
        super().__init__(message, status=status)


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    """How the retry policy treats one exception."""

    kind: str  # transient | not_found | permanent | damaged (retried, then permanent)
    status: int | None = None
    retry_after: float | None = None


_TRANSIENT_NAMES = ("Timeout", "NetworkError", "ProtocolError", "ConnectError", "ReadError")


def _retry_after(headers: object) -> float | None:
    value = headers.get("Retry-After") if isinstance(headers, Mapping) else None
    try:
        return None if value is None else max(0.0, float(str(value).strip()))
    except ValueError:
        return None


def classify_error(exc: BaseException) -> ErrorInfo:
    """The one place where SDK, HTTP and filesystem exceptions are mapped to retry kinds."""
    if isinstance(exc, TransportError):
        return ErrorInfo(exc.kind, exc.status)
    # An HTTP error of the SDK or httpx carries the answer it failed on (third-party objects).
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        if status == 404:
            return ErrorInfo("not_found", status)
        if status in (408, 425, 429) or status >= 500:
            return ErrorInfo("transient", status, _retry_after(getattr(response, "headers", None)))
        return ErrorInfo("permanent", status)
    if isinstance(exc, FileNotFoundError):
        return ErrorInfo("not_found")
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)):
        return ErrorInfo("permanent")
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return ErrorInfo("transient")  # includes EIO/ESTALE and the SDK's consistency errors
    names = " ".join(cls.__name__ for cls in type(exc).__mro__)
    if any(part in names for part in _TRANSIENT_NAMES):
        return ErrorInfo("transient")
    if isinstance(exc, (TypeError, AttributeError, KeyError, NotImplementedError)):
        return ErrorInfo("permanent")  # programming errors are not outages
    if "EntryNotFound" in names or "RepositoryNotFound" in names:
        return ErrorInfo("not_found")
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        return classify_error(cause)  # e.g. the SDK's "Force download failed" wraps a 503
    if isinstance(exc, ValueError):
        return ErrorInfo("permanent")
    return ErrorInfo("transient")


@dataclasses.dataclass
class RetryPolicy:
    """Exponential backoff shared by every store, and the deadline of one call.

    ``initial``/``maximum`` are seconds, ``attempts`` the total number of tries per
    operation; a 429 waits at least its ``Retry-After``. ``timeout`` (seconds) bounds one
    attempt of a network store's call. Only transient errors are retried.
    """

    initial: float = 1.0
    maximum: float = 60.0
    attempts: int = 6
    timeout: float = 60.0
    sleeper: Callable[[float], None] = time.sleep
    secrets: tuple[str, ...] = ()
    on_retry: Callable[[str, int, str], None] | None = None

    def run(self, operation: str, fn: Callable[[], R]) -> R:
        """Call ``fn`` with retries; any failure leaves as a (scrubbed) :class:`TransportError`."""
        delay = self.initial
        attempts = max(1, int(self.attempts))
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except Exception as exc:
                info = classify_error(exc)
                text = scrub(f"{type(exc).__name__}: {exc}", self.secrets)
                if info.kind == "not_found":
                    raise RemoteNotFound(f"{operation}: not found ({text})") from None
                if info.kind == "permanent" and isinstance(exc, TransportError):
                    exc.args = (f"{operation} failed: {text}",)  # keeps its class and status
                    raise exc from None
                if info.kind == "permanent":
                    raise TransportError(
                        f"{operation} failed: {text}", kind="permanent", status=info.status
                    ) from None
                if attempt >= attempts:
                    # a damaged file is the same every time: refused; an outage may pass
                    error = DamagedFile if info.kind == "damaged" else HubUnavailable
                    kind = "permanent" if info.kind == "damaged" else "transient"
                    message = f"{operation} failed after {attempts} attempts: {text}"
                    raise error(message, kind=kind, status=info.status) from None
                wait = delay if info.retry_after is None else max(delay, info.retry_after)
                if self.on_retry is not None:
                    with contextlib.suppress(Exception):
                        self.on_retry(operation, attempt, text)
                self.sleeper(wait)
                delay = min(self.maximum, delay * 2)
        raise AssertionError("unreachable")  # pragma: no cover


def retry_policy_from_config(config: DistributedConfig) -> RetryPolicy:
    """The shared policy from a ``distributed`` config section (the token is a secret)."""
    return RetryPolicy(
        initial=config.retry_initial,
        maximum=config.retry_max,
        attempts=config.retry_attempts,
        timeout=config.request_timeout,
        secrets=(config.token,) if config.token else (),
    )
