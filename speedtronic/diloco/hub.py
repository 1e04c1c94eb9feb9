"""Hugging Face Hub transport (``distributed.repo_id: owner/name``) on ``huggingface_hub.HfApi``.

Calls used (all checked against huggingface_hub 2.4.0): ``create_repo(private=True,
exist_ok=True)``, ``list_repo_tree(recursive=True)`` (paths and sizes),
``hf_hub_download(local_dir=...)`` (HEAD + GET on ``/resolve/``) and ``create_commit`` with
``CommitOperationAdd``/``CommitOperationDelete``: one commit per delta upload, and one commit
for publish + prune on the master. The endpoint comes from the ``endpoint`` argument, else
``HF_ENDPOINT`` read here in the constructor (never at import). The SDK's own retries are
switched off and each primitive call is bounded by ``request_timeout`` (the HTTP layer, below in
this module), so :class:`RetryPolicy` is the one retry layer. Files
the Hub answers ``lfs`` for (10 MiB and more) take the LFS path (batch endpoint, upload to the
storage URL it gives, pointer commit; downloads redirected to storage) through that same
client: Xet, which would move them outside it, is switched off for the process. A large
file's download must match the Hub's record of it (the size, and an LFS object's sha256, from
one HEAD): one that does not is :class:`DamagedFile`, retried and then refused, so a damaged
stored object is one bad file, never an endless outage. The
token (stripped of surrounding whitespace) is handed to the SDK only; it is scrubbed from
every error message, and a 401/403 is a permanent error that says to check the token.

The HTTP layer: one retry layer, bounded calls. huggingface_hub 2.x retries inside its own
calls: ``http_backoff`` (used by listings, ``create_commit``, the LFS endpoints and storage
PUTs, and ``hf_hub_download``'s HEAD/GET)
retries 408, 429 and 5xx answers, timeouts and dropped connections up to five times, sleeping
1, 2, 4, 8, 8 s and logging ``Retrying in ...`` lines; ``hf_hub_download`` resumes broken
bodies on its own. There is no environment knob for it. Nested inside
:class:`RetryPolicy`, one of our attempts could take 23 s of SDK
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
import io
import ipaddress
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from speedtronic.diloco.exchange import (
    GLOBAL_STEP,
    AccessRefused,
    DamagedFile,
    FileInfo,
    HubUnavailable,
    RemoteNotFound,
    RepoTransport,
    RetryPolicy,
    TransportError,
    file_sha256,
    too_large,
)

__all__ = [
    "BYTES_PER_SECOND",
    "HubCallTimeout",
    "HubClient",
    "HubConnectionError",
    "HubHTTPStatus",
    "HubTransport",
    "hub_call",
    "install_sdk_client",
    "install_sdk_timeouts",
]

_LOG = logging.getLogger("speedtronic.diloco")
_POINTERS = frozenset({GLOBAL_STEP})  # read by every node at every poll


_FILE_MISSING = ("EntryNotFoundError", "RevisionNotFoundError")


def _answer(exc: BaseException) -> tuple[int | None, str]:
    """The HTTP status behind ``exc`` (the SDK wraps some, e.g. a forced download's failed
    HEAD in a ValueError) and what the Hub said is missing: ``repo`` (the repository),
    ``file`` (a file or revision of a repository that answered) or ``""`` (nothing said)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        status = getattr(getattr(current, "response", None), "status_code", None)
        if isinstance(status, int):
            names = {cls.__name__ for cls in type(current).__mro__}
            if "RepositoryNotFoundError" in names:
                return status, "repo"
            return status, "file" if names & set(_FILE_MISSING) else ""
        current = current.__cause__ or current.__context__
    return None, ""


def _auth_refused(status: int, repo_id: str, has_token: bool) -> AccessRefused:
    """A 401/403 from the Hub as a permanent error that says what to fix (never the token)."""
    if not has_token:
        problem = "requires a token and none is configured"
    elif status == 401:
        problem = "rejected the token"
    else:
        problem = "refused access with this token (no write access to the repository?)"
    return AccessRefused(
        f"the Hub {problem} (HTTP {status}) for {repo_id}; check HF_TOKEN or the hf_token "
        "secret file",
        status=status,
    )


def _repo_hidden(repo_id: str, has_token: bool) -> AccessRefused:
    """A 404 "Repository not found" for our own repository: the token cannot see it."""
    who = "this token cannot see it" if has_token else "no token is configured"
    return AccessRefused(
        f"the Hub answers 404 Repository not found for {repo_id}: {who} (or it was never "
        "created); check that HF_TOKEN or the hf_token secret file holds a token with write "
        "access to it",
        status=404,
    )


# -- the HTTP client huggingface_hub uses in this process ------------------------------
#: Transfer rate a call is always granted on top of ``request_timeout`` (bytes per second).
BYTES_PER_SECOND = 1024 * 1024
_RETRIED_STATUSES = frozenset({408, 425, 429})
_CHUNK = 1024 * 1024
_LOCK = threading.Lock()
_INSTALLED: list[bool] = []
#: Per-request timeout (seconds) for requests outside a call: the latest call's timeout.
_OUTSIDE_TIMEOUT = [60.0]


class HubCallTimeout(TimeoutError):
    """A Hub call ran past its deadline (``request_timeout`` plus transfer allowance)."""


class HubConnectionError(ConnectionError):
    """A connection to the Hub failed, was dropped, or ended in the middle of a body."""


class HubHTTPStatus(Exception):
    """The Hub answered with a status worth retrying (408, 425, 429, 5xx).

    ``response`` keeps ``status_code`` and ``headers`` (``Retry-After``) for
    :func:`speedtronic.diloco.exchange.classify_error`; the body is not kept.
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


_LEGACY_RETRY = {
    "retry_initial": "initial",
    "retry_max": "maximum",
    "retry_attempts": "attempts",
    "request_timeout": "timeout",
}


def _legacy_retry(keywords: dict[str, float]) -> dict[str, float]:
    """2.0.0's ``HubClient(retry_initial=..., retry_max=..., retry_attempts=...)`` as
    :class:`RetryPolicy` fields, with a ``DeprecationWarning``; any other keyword is a
    ``TypeError`` as for any call."""
    unknown = sorted(set(keywords) - set(_LEGACY_RETRY))
    if unknown:
        raise TypeError(f"HubClient() got unexpected keyword arguments: {', '.join(unknown)}")
    warnings.warn(
        "HubClient(retry_initial=, retry_max=, retry_attempts=, request_timeout=) is deprecated;"
        " pass retry=RetryPolicy(...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return {_LEGACY_RETRY[key]: value for key, value in keywords.items()}


class HubClient(RepoTransport):
    """A Hub model repository used as the DumbDiLoCo rendezvous (private, one per run).

    ``retry`` (:class:`RetryPolicy`: backoff, attempts, per-request timeout) defaults to
    2.0.0's 1 s .. 60 s over 6 tries; ``sleeper`` replaces its sleep (tests). ``api`` injects
    an SDK-like object, ``endpoint`` another Hub (default ``HF_ENDPOINT``). A repository that
    answers "not found" is taken for one not created yet for ``missing_repo_wait`` seconds.
    """

    kind = "hub"

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        api: Any = None,
        endpoint: str | None = None,
        retry: RetryPolicy | None = None,
        sleeper: Callable[[float], None] | None = None,
        missing_repo_wait: float = 0.0,
        **legacy: float,
    ):
        retry = retry if retry is not None else RetryPolicy()  # 1 s .. 60 s, 6 tries, 60 s each
        if legacy:  # 2.0.0's loose retry keywords, kept working
            retry = dataclasses.replace(retry, **_legacy_retry(legacy))
        if sleeper is not None:
            retry = dataclasses.replace(retry, sleeper=sleeper)
        token = token.strip() if token else token  # a secret file's trailing newline
        if token:
            retry.secrets = (*retry.secrets, token)
        super().__init__(repo_id, retry)
        self._token = token
        self.endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
        self.cache_dir = (
            Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "speedtronic-hub"
        )
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.staging_dir = self.cache_dir  # uploads are staged beside the downloads
        self._api = api
        self._pointers: dict[str, tuple[str, bytes]] = {}  # path -> (etag, content)
        self.missing_repo_wait = float(missing_repo_wait)
        self._repo_seen = False  # the Hub answered about the repository itself at least once
        self._repo_missing_since: float | None = None

    def __repr__(self) -> str:  # never show the token
        return f"HubClient(repo_id={self.repo_id!r}, endpoint={self.endpoint!r})"

    @property
    def api(self) -> Any:
        """The ``HfApi`` (built on first use)."""
        if self._api is None:
            try:
                from huggingface_hub import HfApi
                from huggingface_hub.utils import disable_progress_bars
            except ImportError:
                raise HubUnavailable("huggingface_hub is required for the Hub transport") from None
            disable_progress_bars()
            install_sdk_client()
            self._api = HfApi(endpoint=self.endpoint, token=self._token)
        return self._api

    def _scoped(self, fn: Any, *args: Any) -> Any:
        _ = self.api  # build the client (and install the SDK client) before the first request
        try:
            with hub_call(self.retry.timeout):
                out = fn(*args)
        except Exception as exc:
            refused = self._refusal(exc)
            if refused is None:
                raise
            raise refused from None
        self._repo_seen, self._repo_missing_since = True, None
        return out

    def _refusal(self, exc: BaseException) -> TransportError | None:
        """Access errors as permanent ``AccessRefused``: 401, 403, and a 404 "Repository not
        found" once this client has seen the repository or waited ``missing_repo_wait``
        seconds for it (the Hub answers a repository that is not created yet, e.g. a worker
        started before its master, exactly as one the token cannot see; until then it is
        ``RemoteNotFound``). A 404 for a file is left alone (``RemoteNotFound``); a 404 that
        names nothing (e.g. no such route: a server that is not a Hub, or a repository id it
        cannot route) counts as the repository missing until this client saw it answer."""
        status, missing = _answer(exc)
        if status in (401, 403):
            return _auth_refused(status, self.repo_id, bool(self._token))
        if status != 404:
            return None
        if missing == "file" or (not missing and self._repo_seen):
            self._repo_seen = True  # a file is missing: the repository itself answered
            return None
        now = time.monotonic()
        if self._repo_missing_since is None:
            self._repo_missing_since = now
        waited = now - self._repo_missing_since
        if self._repo_seen or waited >= self.missing_repo_wait:
            return _repo_hidden(self.repo_id, bool(self._token))
        return RemoteNotFound(
            f"repository {self.repo_id} not found yet (its master creates it; waited "
            f"{waited:.1f} of {self.missing_repo_wait:g} s)"
        )

    def _create_repo(self, private: bool) -> None:
        self.api.create_repo(self.repo_id, repo_type="model", private=private, exist_ok=True)

    def _grant(self, username: str, permission: str) -> None:
        grant = getattr(self.api, "add_collaborator", None)
        if grant is None:
            raise TransportError(
                "this huggingface_hub SDK cannot add collaborators; grant access in the Hub UI",
                kind="permanent",
            )
        grant(username, repo_id=self.repo_id, repo_type="model", permission=permission)

    def _list(self) -> dict[str, FileInfo]:
        entries = self.api.list_repo_tree(self.repo_id, recursive=True, repo_type="model")
        out: dict[str, FileInfo] = {}
        for entry in entries or []:
            if hasattr(entry, "size") and not hasattr(entry, "tree_id"):  # a file, not a folder
                size = getattr(entry, "size", None)
                blob = getattr(entry, "blob_id", None)
                out[str(entry.path)] = FileInfo(
                    int(size) if isinstance(size, int) else None, str(blob) if blob else None
                )
        return out

    def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        if path in _POINTERS and max_bytes is None:
            return self._read_pointer(path)
        return self._download(path, max_bytes)

    def _read_pointer(self, path: str) -> bytes:
        """A small file every node polls (the global's version record): one HEAD request
        while its ETag is the one already read, a download only when it changed, so a poll
        costs one request however long the run or large the repository."""
        from huggingface_hub import hf_hub_url

        url = hf_hub_url(self.repo_id, path, repo_type="model", endpoint=self.endpoint)
        etag = self.api.get_hf_file_metadata(
            url=url, token=self._token, timeout=self.retry.timeout
        ).etag
        cached = self._pointers.get(path)
        if etag and cached is not None and cached[0] == etag:
            return cached[1]
        data = self._download(path)
        if etag:  # the ETag of the HEAD: content newer than it is only read once more
            self._pointers[path] = (etag, data)
        return data

    def _download(self, path: str, max_bytes: int | None = None) -> bytes:
        """The content of ``path`` (see :meth:`_fetch`), read into memory."""
        tmp = tempfile.mkdtemp(prefix="speedtronic-download-", dir=self.cache_dir)
        try:
            return self._fetch(path, max_bytes, Path(tmp)).read_bytes()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _fetch(self, path: str, max_bytes: int | None, into: Path) -> Path:
        """Download ``path`` into the directory ``into``, whole and intact.

        With ``max_bytes`` (the large files: deltas, globals, updates), one HEAD first: a
        file the Hub lists as larger is refused unread, and the downloaded file must have the
        size and, where the Hub names it (a 64-hex ETag: the sha256 of an LFS object), the
        sha256 that HEAD gave. The SDK checks every download's size against the Hub's record
        (the LFS pointer's) itself. A file that disagrees is :class:`DamagedFile`: retried,
        then permanent (a stored object cut short or replaced never reads whole)."""
        expected: tuple[int | None, str] = (None, "")
        if max_bytes is not None:
            from huggingface_hub import hf_hub_url

            url = hf_hub_url(self.repo_id, path, repo_type="model", endpoint=self.endpoint)
            meta = self.api.get_hf_file_metadata(
                url=url, token=self._token, timeout=self.retry.timeout
            )
            size = meta.size if isinstance(meta.size, int) else None
            if size is not None and size > max_bytes:
                raise too_large(path, size, max_bytes)
            etag = str(meta.etag or "").strip('"').lower()
            expected = (size, etag if _SHA256.fullmatch(etag) else "")
        try:
            local = Path(
                self.api.hf_hub_download(
                    repo_id=self.repo_id,
                    filename=path,
                    local_dir=into,
                    repo_type="model",
                    token=self._token,
                    force_download=True,
                    etag_timeout=self.retry.timeout,
                )
            )
        except OSError as exc:
            # The SDK's size check raises a bare OSError (no errno); a network failure here
            # is one of ours (HubConnectionError, HubCallTimeout), a disk error has an errno.
            if type(exc) is OSError and exc.errno is None:
                said = re.sub(r"\s*\(.*", "", str(exc).splitlines()[0] if str(exc) else "")
                raise DamagedFile(f"{path} did not download whole: {said}") from None
            raise
        size = local.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise too_large(path, size, max_bytes)
        _check_whole(path, local, *expected)
        return local

    @contextlib.contextmanager
    def local_copy(self, path: str, max_bytes: int | None = None) -> Iterator[Path]:
        """The downloaded file itself for the ``with`` block (retried, bounded by
        ``max_bytes`` on the file; removed afterwards), never read into memory here: the master
        reads a delta from it one tensor at a time. A missing file is ``RemoteNotFound``."""
        with tempfile.TemporaryDirectory(prefix="speedtronic-download-", dir=self.cache_dir) as tmp:
            yield self.retry.run(
                f"download {path}", lambda: self._scoped(self._fetch, path, max_bytes, Path(tmp))
            )

    def _commit(
        self, additions: Mapping[str, bytes | Path], deletions: list[str], message: str
    ) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        operations: list[Any] = [  # a staged file is read from disk as it is sent
            CommitOperationAdd(
                path_in_repo=path,
                path_or_fileobj=str(data) if isinstance(data, Path) else io.BytesIO(data),
            )
            for path, data in additions.items()
        ]
        operations += [CommitOperationDelete(path_in_repo=path) for path in deletions]
        self.api.create_commit(
            self.repo_id, operations=operations, commit_message=message, repo_type="model"
        )


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_whole(path: str, local: Path, size: int | None, sha256: str) -> None:
    """:class:`DamagedFile` unless the downloaded ``local`` has the ``size`` and ``sha256``
    the Hub's record gives (each checked when known)."""
    got = local.stat().st_size
    if size is not None and got != size:
        raise DamagedFile(f"{path} read {got} bytes; the Hub's record of it says {size}")
    if sha256:
        digest = file_sha256(local)
        if digest != sha256:
            raise DamagedFile(
                f"{path} does not hash to the Hub's record of it (sha256 {digest[:12]}..., "
                f"the record names {sha256[:12]}...): the stored object is damaged"
            )


HubTransport = HubClient


#: 2.1 name of :func:`install_sdk_client`.
install_sdk_timeouts = install_sdk_client
