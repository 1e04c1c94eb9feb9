"""Errors and the one retry policy shared by every DumbDiLoCo transport.

Every failure of a transport primitive is mapped to :class:`TransportError` in one place
(:func:`classify_error` + :meth:`RetryPolicy.run`): ``transient`` failures (outages, 5xx,
429, timeouts, dropped connections) are retried with exponential backoff, ``not_found`` and
``permanent`` ones (auth, bad request, programming errors) are not. Messages never carry the
token (:func:`scrub`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from speedtronic.config import redaction
from speedtronic.config.errors import ConfigError

__all__ = [
    "AccessRefused",
    "ErrorInfo",
    "ExchangeError",
    "HubError",
    "HubUnavailable",
    "RemoteNotFound",
    "RetryPolicy",
    "TransportError",
    "classify_error",
    "retry_policy_from_config",
    "scrub",
]

R = TypeVar("R")


class TransportError(RuntimeError):
    """A transport operation failed (after retries when the error was transient).

    ``kind`` is ``transient`` (outage, 5xx, 429, timeout), ``not_found`` or ``permanent``
    (auth, bad request, unsupported); ``status`` is the HTTP status when there was one.
    """

    def __init__(self, message: str, *, kind: str = "transient", status: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.status = status


#: 2.0.0 names: ``HubError`` (RuntimeError) and ``HubUnavailable`` (HubError).
HubError = TransportError


class ExchangeError(ConfigError):
    """A permanent misconfiguration of the exchange (auth refused, repository or path not
    usable, a model that does not match): the node stops with exit code 2 and one line."""


class AccessRefused(TransportError):
    """The exchange refuses this process: the Hub answered 401 or 403, or 404 "Repository
    not found" for our own repository (a token that cannot see it). Always permanent; the
    message names the repository and what to check, never the token."""

    def __init__(self, message: str, *, status: int | None = None, kind: str = "permanent"):
        super().__init__(message, kind=kind, status=status)


class HubUnavailable(TransportError):
    """Retries exhausted, or the SDK is missing."""


class RemoteNotFound(TransportError):
    """The remote file or repository does not exist."""

    def __init__(self, message: str, *, status: int | None = 404):
        super().__init__(message, kind="not_found", status=status)


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    """How the retry policy treats one exception."""

    kind: str  # transient | not_found | permanent
    status: int | None = None
    retry_after: float | None = None


_TRANSIENT_NAMES = ("Timeout", "NetworkError", "ProtocolError", "ConnectError", "ReadError")


def _retry_after(headers: Any) -> float | None:
    try:
        value = headers.get("Retry-After") if headers is not None else None
    except Exception:
        return None
    if value is None:
        return None
    try:
        return max(0.0, float(str(value).strip()))
    except ValueError:
        return None


def classify_error(exc: BaseException) -> ErrorInfo:
    """The one place where SDK, HTTP and filesystem exceptions are mapped to retry kinds."""
    if isinstance(exc, TransportError):
        return ErrorInfo(exc.kind, exc.status)
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        headers = getattr(response, "headers", None)
        if status == 404:
            return ErrorInfo("not_found", status)
        if status in (408, 425, 429) or status >= 500:
            return ErrorInfo("transient", status, _retry_after(headers))
        return ErrorInfo("permanent", status)
    if isinstance(exc, FileNotFoundError):
        return ErrorInfo("not_found")
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)):
        return ErrorInfo("permanent")
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return ErrorInfo("transient")  # includes EIO/ESTALE and the SDK's consistency errors
    names = [cls.__name__ for cls in type(exc).__mro__]
    if any(part in name for name in names for part in _TRANSIENT_NAMES):
        return ErrorInfo("transient")
    if isinstance(exc, (TypeError, AttributeError, KeyError, NotImplementedError)):
        return ErrorInfo("permanent")  # programming errors are not outages
    if "EntryNotFound" in " ".join(names) or "RepositoryNotFound" in " ".join(names):
        return ErrorInfo("not_found")
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        return classify_error(cause)  # e.g. the SDK's "Force download failed" wraps a 503
    if isinstance(exc, ValueError):
        return ErrorInfo("permanent")
    return ErrorInfo("transient")


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """Replace every secret (the Hub token) in ``text`` by ``<redacted>``, in every form it
    can take there: raw, whitespace-stripped, repr/JSON-escaped, header bytes, percent or
    base64 encoded, and any token-shaped string (see :mod:`speedtronic.config.redaction`)."""
    return redaction.scrub(text, secrets)


@dataclasses.dataclass
class RetryPolicy:
    """Exponential backoff shared by every transport.

    ``initial``/``maximum`` are seconds, ``attempts`` is the total number of tries per
    operation; a 429 waits at least its ``Retry-After``. ``timeout`` (seconds) is the
    per-request timeout handed to network transports. Only transient errors are retried.
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
                    raise HubUnavailable(
                        f"{operation} failed after {attempts} attempts: {text}",
                        kind="transient",
                        status=info.status,
                    ) from None
                wait = delay if info.retry_after is None else max(delay, info.retry_after)
                if self.on_retry is not None:
                    with contextlib.suppress(Exception):
                        self.on_retry(operation, attempt, text)
                self.sleeper(wait)
                delay = min(self.maximum, delay * 2)
        raise AssertionError("unreachable")  # pragma: no cover


def retry_policy_from_config(config: Any) -> RetryPolicy:
    """The shared policy from a ``distributed`` config section (the token is a secret)."""
    return RetryPolicy(
        initial=config.retry_initial,
        maximum=config.retry_max,
        attempts=config.retry_attempts,
        timeout=config.request_timeout,
        secrets=(config.token,) if config.token else (),
    )
