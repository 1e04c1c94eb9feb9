"""Hugging Face Hub store (``distributed.repo_id: owner/name``) on ``huggingface_hub.HfApi``.

Calls used (huggingface_hub 2.4.0): ``create_repo(private=True, exist_ok=True)``,
``list_repo_tree(recursive=True)``, ``get_hf_file_metadata`` (one HEAD),
``hf_hub_download(local_dir=...)``, ``preupload_lfs_files`` + ``create_commit`` (one commit per
delta upload, one for publish + prune). The endpoint is ``endpoint``, else ``HF_ENDPOINT``
(read in the constructor). The token (whitespace stripped) goes to the SDK only and is scrubbed
from every message; 401/403 are permanent errors that say to check it. A large file's download
must match the Hub's record of it (size, and an LFS object's sha256, from one HEAD), else it is
:class:`DamagedFile`: retried, then refused.

One retry layer, bounded calls. The SDK retries inside its calls (408, 429, 5xx, timeouts,
dropped connections; up to five times, 1 to 8 s apart): nested in the store's
:class:`RetryPolicy` that made one attempt last 23 s and ``request_timeout`` bound nothing. The
SDK reaches the network only through its shared client, so the store gives it one
(:class:`HubSession`, through ``set_client_factory``): the SDK's default client for every
request, which inside a HubClient call (:func:`hub_call`, a context variable) also

* turns a 408/425/429/5xx answer into :class:`HubHTTPStatus` (status, ``Retry-After``), a
  timeout into :class:`HubCallTimeout`, a dropped connection or cut body into
  :class:`HubConnectionError`: errors the SDK does not retry and the policy does;
* gives the call's requests one deadline, ``request_timeout`` plus one second per MiB moved
  (a transfer that keeps moving is not cut off, a stalled server is), each request's timeouts
  being the time left;
* keeps the transfer off Xet (which moves files in Rust, past any deadline): its headers are
  dropped from the answers, and uploads are handed over as open files, so large files take the
  LFS path. Each staged file is uploaded in a call of its own: the SDK sends several LFS files
  of one call from worker threads, which the call's context does not reach;
* lets a background call's upload (``commit(background=True)``: a new run's global 0) give way
  to the process's foreground ones (:data:`UPLINK`, below).

Every other request of the process is sent as the SDK's default client sends it (its retries,
its timeouts, Xet if installed). Only public huggingface_hub names are used
(``tests/test_hub_public_api.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import io
import logging
import os
import re
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2

from speedtronic.diloco.codec import file_sha256
from speedtronic.diloco.exchange import (
    GLOBAL_STEP,
    FileInfo,
    R,
    RepoTransport,
    too_large,
)
from speedtronic.retry import (
    AccessRefused,
    DamagedFile,
    RemoteNotFound,
    RetryPolicy,
    TransportError,
)

if TYPE_CHECKING:
    from huggingface_hub import HfApi

#: Transfer rate a call is always granted on top of ``request_timeout`` (bytes per second).
BYTES_PER_SECOND = 1024 * 1024
_RETRIED = frozenset({408, 425, 429})
_CHUNK = 1024 * 1024
_POINTERS = frozenset({GLOBAL_STEP})  # read by every node at every poll
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_MISSING = frozenset({"EntryNotFoundError", "RevisionNotFoundError"})


# -- one process's uplink: a background upload gives way ----------------------------------
# The master sends a new run's global 0 (12 MB of fp32 weights for the link bench's model)
# after the record that names it, on a thread of its own, while the first rounds publish their
# updates (``exchange.WeightsUpload``). Over a slow link the two uploads shared the uplink as
# TCP shares it: the long one, its window already open, took most of it, and global 1's update
# (1 MB) took 5 s instead of 0.9, which both nodes of the link bench waited for. A background
# upload (``Store.commit(background=True)``) gives way: UPLINK counts the foreground request
# bodies being sent (over SMALL_BODY: an LFS upload; records and commits are small), from their
# first byte until the Hub's answer; a background body waits before each piece while one is
# (``_Bounded``), for at most half of its call's timeout in all (a link the rounds fill never
# starves it past its deadline; the wait does not count against that deadline). What it handed
# to the kernel before it stopped (its socket's send buffer) still goes out beside the
# foreground one: a fraction of a second at 10 Mbit/s. A volume store writes at once.

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


# -- one call's deadline, and the client the SDK uses --------------------------------------
class HubCallTimeout(TimeoutError):
    """A Hub call ran past its deadline (``request_timeout`` plus transfer allowance)."""


class HubConnectionError(ConnectionError):
    """A connection to the Hub failed, was dropped, or ended in the middle of a body."""


class HubHTTPStatus(Exception):
    """The Hub answered a status worth retrying (408, 425, 429, 5xx). ``response`` (closed)
    keeps ``status_code`` and ``headers`` (``Retry-After``) for ``classify_error``."""

    def __init__(self, request: httpx2.Request, response: httpx2.Response) -> None:
        super().__init__(f"HTTP {response.status_code} from {request.method} {request.url.path}")
        self.response = response


@dataclasses.dataclass
class HubCall:
    """One HubClient call: its requests share the deadline (``time.monotonic()`` seconds)."""

    timeout: float
    deadline: float
    #: A background call (``commit(background=True)``): its uploads give way (``UPLINK``).
    background: bool = False
    #: Seconds its uploads waited for the foreground ones (not counted against ``deadline``).
    held: float = 0.0

    def left(self) -> float:
        """Seconds left."""
        return self.deadline - time.monotonic()

    def moved(self, nbytes: int) -> None:
        """``nbytes`` went over the wire: the deadline moves by their allowance."""
        self.deadline += nbytes / BYTES_PER_SECOND

    def expired(self, what: str) -> HubCallTimeout:
        """The error of a request that finds no time left."""
        return HubCallTimeout(f"{what}: no answer within the call's {self.timeout:g} s timeout")


#: The HubClient call this context is in (None: a request that is not ours).
_CALL: contextvars.ContextVar[HubCall | None] = contextvars.ContextVar("hub_call", default=None)
#: Whether this context commits in the background (``HubClient.commit(background=True)``).
_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("hub_background", default=False)


@contextlib.contextmanager
def hub_call(timeout: float, *, background: bool = False) -> Iterator[HubCall]:
    """Run one Hub call (any number of SDK requests) under one deadline of ``timeout`` s;
    ``background``: its uploads give way to this process's other uploads (``UPLINK``)."""
    call = HubCall(float(timeout), time.monotonic() + float(timeout), background)
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """httpx failures as the transient errors the SDK does not retry."""
    try:
        yield
    except httpx2.TimeoutException as exc:
        raise HubCallTimeout(f"{what}: timed out ({type(exc).__name__})") from None
    except (httpx2.NetworkError, httpx2.RemoteProtocolError) as exc:
        raise HubConnectionError(
            f"{what}: connection failed ({type(exc).__name__}: {exc})"
        ) from None


class _Bounded(httpx2.SyncByteStream):
    """A request or response body of a call: every MiB counts towards its deadline. A request
    body of a background call waits before each piece while a foreground one is sent (at
    most half of the call's timeout in all; the wait moves the deadline)."""

    def __init__(
        self, inner: httpx2.SyncByteStream, call: HubCall, what: str, *, upload: bool = False
    ) -> None:
        self._inner, self._call, self._what = inner, call, what
        self._yields = upload and call.background

    def __iter__(self) -> Iterator[bytes]:
        call = self._call
        with _translated(self._what):
            for chunk in self._inner:
                for start in range(0, len(chunk), _CHUNK):
                    if self._yields:
                        waited = UPLINK.give_way(call.timeout / 2 - call.held)
                        call.held += waited
                        call.deadline += waited
                    if self._call.left() <= 0:
                        raise self._call.expired(self._what)
                    piece = chunk[start : start + _CHUNK]
                    self._call.moved(len(piece))
                    yield piece

    def close(self) -> None:
        self._inner.close()


class HubSession(httpx2.Client):
    """The client huggingface_hub shares in this process (see the module): its default one
    (redirects followed, no client-wide timeout, offline mode refused and a request id set as
    its own hook does), which bounds the requests made inside a :func:`hub_call`."""

    def __init__(self) -> None:
        super().__init__(
            event_hooks={"request": [self._on_request], "response": [self._on_response]},
            follow_redirects=True,
            timeout=None,
        )

    def send(self, request: httpx2.Request, **options: Any) -> httpx2.Response:
        """Send as httpx does; inside a call, its failures as errors the SDK does not retry."""
        call = _CALL.get()
        if call is None:
            return super().send(request, **options)
        front = not call.background and large_body(request)  # background uploads give way
        sending = UPLINK.sending() if front else contextlib.nullcontext()
        with _translated(f"{request.method} {request.url.path}"), sending:
            return super().send(request, **options)

    @staticmethod
    def _on_request(request: httpx2.Request) -> None:
        from huggingface_hub import constants
        from huggingface_hub.errors import OfflineModeIsEnabled

        if constants.is_offline_mode():
            raise OfflineModeIsEnabled(f"Cannot reach {request.url}: offline mode is enabled.")
        trace = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        request.headers.setdefault("X-Amzn-Trace-Id", trace)
        call = _CALL.get()
        if call is None:
            return
        what = f"{request.method} {request.url.path}"
        if call.left() <= 0:
            raise call.expired(what)
        limit = min(call.timeout, call.left())
        request.extensions["timeout"] = dict.fromkeys(("connect", "read", "write", "pool"), limit)
        stream = request.stream  # a redirect keeps the (bounded) body
        if isinstance(stream, httpx2.SyncByteStream) and not isinstance(stream, _Bounded):
            request.stream = _Bounded(stream, call, what, upload=True)

    @staticmethod
    def _on_response(response: httpx2.Response) -> None:
        call = _CALL.get()
        if call is None:
            return
        for name in [name for name in response.headers if name.lower().startswith("x-xet-")]:
            del response.headers[name]  # a download of ours stays on this client
        request = response.request
        if response.status_code in _RETRIED or response.status_code >= 500:
            response.close()
            raise HubHTTPStatus(request, response)
        if isinstance(response.stream, httpx2.SyncByteStream):
            what = f"{request.method} {request.url.path}"
            response.stream = _Bounded(response.stream, call, what)


class _XetNotice(logging.Filter):
    """Drops the SDK's warning that an upload of a HubClient call falls back from Xet to the
    LFS path (we hand it open files for that); anyone else's warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _CALL.get() is None or "Xet" not in record.getMessage()


def install_session() -> None:
    """Give huggingface_hub the :class:`HubSession` (once per process; harmless twice)."""
    import huggingface_hub

    if not isinstance(huggingface_hub.get_session(), HubSession):
        huggingface_hub.set_client_factory(HubSession)
    commits = logging.getLogger("huggingface_hub._commit_api")  # where the SDK says it
    if not any(isinstance(f, _XetNotice) for f in commits.filters):
        commits.addFilter(_XetNotice())


# -- the store -------------------------------------------------------------------------------
def _answer(exc: BaseException) -> tuple[int | None, str]:
    """The HTTP status behind ``exc`` (the SDK wraps some, e.g. a forced download's failed
    HEAD in a ValueError) and what the Hub said is missing: ``repo`` (the repository),
    ``file`` (a file or revision of a repository that answered) or ``""`` (nothing said)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        # the SDK's HTTP errors carry the answer they failed on (third-party objects)
        status = getattr(getattr(current, "response", None), "status_code", None)
        if isinstance(status, int):
            names = {cls.__name__ for cls in type(current).__mro__}
            if "RepositoryNotFoundError" in names:
                return status, "repo"
            return status, "file" if names & _FILE_MISSING else ""
        current = current.__cause__ or current.__context__
    return None, ""


_LEGACY_RETRY = {
    "retry_initial": "initial",
    "retry_max": "maximum",
    "retry_attempts": "attempts",
    "request_timeout": "timeout",
}


class HubClient(RepoTransport):
    """A Hub model repository used as the DumbDiLoCo rendezvous (private, one per run).

    ``retry`` (:class:`RetryPolicy`: backoff, attempts, the deadline of one call) defaults to
    1 s .. 60 s over 6 tries of 60 s; ``sleeper`` replaces its sleep (2.0.0). ``api`` injects
    an SDK-like object, ``endpoint`` another Hub (default ``HF_ENDPOINT``). A repository that
    answers "not found" is taken for one not created yet for ``missing_repo_wait`` seconds.
    2.0.0's ``retry_initial=``, ``retry_max=``, ``retry_attempts=`` and ``request_timeout=``
    still set the policy's fields, with a ``DeprecationWarning``.
    """

    kind = "hub"

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        api: HfApi | None = None,
        endpoint: str | None = None,
        retry: RetryPolicy | None = None,
        sleeper: Callable[[float], None] | None = None,
        missing_repo_wait: float = 0.0,
        **legacy: float,
    ):
        retry = retry if retry is not None else RetryPolicy()
        if legacy:
            unknown = sorted(set(legacy) - set(_LEGACY_RETRY))
            if unknown:
                raise TypeError(
                    f"HubClient() got unexpected keyword arguments: {', '.join(unknown)}"
                )
            warnings.warn(
                "HubClient(retry_initial=, retry_max=, retry_attempts=, request_timeout=) is "
                "deprecated; pass retry=RetryPolicy(...)",
                DeprecationWarning,
                stacklevel=2,
            )
            retry = dataclasses.replace(retry)
            for key, value in legacy.items():
                setattr(retry, _LEGACY_RETRY[key], value)
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
    def api(self) -> HfApi:
        """The ``HfApi`` (built on first use)."""
        if self._api is None:
            from huggingface_hub import HfApi  # a dependency; imported when first needed

            self._api = HfApi(endpoint=self.endpoint, token=self._token)
        return self._api

    def _attempt(self, fn: Callable[[], R]) -> R:
        install_session()  # before the first request of the SDK
        try:
            with hub_call(self.retry.timeout, background=_BACKGROUND.get()):
                out = fn()
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
        where = f"for {self.repo_id}; check HF_TOKEN or the hf_token secret file"
        if status in (401, 403):
            if not self._token:
                problem = "requires a token and none is configured"
            elif status == 401:
                problem = "rejected the token"
            else:
                problem = "refused access with this token (no write access to the repository?)"
            return AccessRefused(f"the Hub {problem} (HTTP {status}) {where}", status=status)
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
            who = "this token cannot see it" if self._token else "no token is configured"
            return AccessRefused(
                f"the Hub answers 404 Repository not found for {self.repo_id}: {who} (or it "
                "was never created); check that HF_TOKEN or the hf_token secret file holds a "
                "token with write access to it",
                status=404,
            )
        return RemoteNotFound(
            f"repository {self.repo_id} not found yet (its master creates it; waited "
            f"{waited:.1f} of {self.missing_repo_wait:g} s)"
        )

    @contextlib.contextmanager
    def _lane(self, background: bool) -> Iterator[None]:
        """A ``background`` commit's files give way to this process's other uploads
        (:data:`UPLINK`), in every attempt (each attempt's ``hub_call`` reads the lane)."""
        token = _BACKGROUND.set(background)
        try:
            yield
        finally:
            _BACKGROUND.reset(token)

    def _create_repo(self, private: bool) -> None:
        self.api.create_repo(self.repo_id, repo_type="model", private=private, exist_ok=True)

    def _grant(self, username: str, permission: str) -> None:
        raise TransportError(
            "huggingface_hub cannot add collaborators; grant access in the Hub UI",
            kind="permanent",
        )

    def _list(self) -> dict[str, FileInfo]:
        from huggingface_hub import RepoFile

        entries = self.api.list_repo_tree(self.repo_id, recursive=True, repo_type="model")
        return {
            entry.path: FileInfo(entry.size, entry.blob_id or None)
            for entry in entries
            if isinstance(entry, RepoFile)
        }

    def _head(self, path: str) -> tuple[str, int | None]:
        """The ETag (quotes stripped) and size the Hub gives for ``path`` (one HEAD)."""
        from huggingface_hub import hf_hub_url

        url = hf_hub_url(self.repo_id, path, repo_type="model", endpoint=self.endpoint)
        meta = self.api.get_hf_file_metadata(url=url, token=self._token, timeout=self.retry.timeout)
        return str(meta.etag or "").strip('"'), meta.size

    def _read(self, path: str, max_bytes: int | None) -> bytes:
        if path not in _POINTERS or max_bytes is not None:
            return self._download(path, max_bytes)
        # The version record every node polls: one HEAD while its ETag is the one already
        # read, a download only when it changed, so a poll costs one request.
        etag, _ = self._head(path)
        cached = self._pointers.get(path)
        if etag and cached is not None and cached[0] == etag:
            return cached[1]
        data = self._download(path, None)
        if etag:  # the ETag of the HEAD: content newer than it is only read once more
            self._pointers[path] = (etag, data)
        return data

    def _download(self, path: str, max_bytes: int | None) -> bytes:
        with tempfile.TemporaryDirectory(prefix="speedtronic-download-", dir=self.cache_dir) as tmp:
            return self._fetch(path, max_bytes, Path(tmp)).read_bytes()

    def _fetch(self, path: str, max_bytes: int | None, into: Path) -> Path:
        """Download ``path`` into the directory ``into``, whole and intact. With ``max_bytes``
        (deltas, globals, updates) one HEAD first: a file listed larger is refused unread, and
        the download must have the size and, where the Hub names it (a 64-hex ETag: an LFS
        object's sha256), the sha256 that HEAD gave, else :class:`DamagedFile` (the SDK checks
        the size against the LFS pointer's itself)."""
        size: int | None = None
        sha256 = ""
        if max_bytes is not None:
            etag, size = self._head(path)
            if size is not None and size > max_bytes:
                raise too_large(path, size, max_bytes)
            sha256 = etag.lower() if _SHA256.fullmatch(etag.lower()) else ""
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
                    tqdm_class=_quiet_bar(),
                )
            )
        except OSError as exc:
            # The SDK's size check raises a bare OSError (no errno); a network failure here
            # is one of ours (HubConnectionError, HubCallTimeout), a disk error has an errno.
            if type(exc) is OSError and exc.errno is None:
                said = re.sub(r"\s*\(.*", "", str(exc).splitlines()[0] if str(exc) else "")
                raise DamagedFile(f"{path} did not download whole: {said}") from None
            raise
        got = local.stat().st_size
        if max_bytes is not None and got > max_bytes:
            raise too_large(path, got, max_bytes)
        if size is not None and got != size:
            raise DamagedFile(f"{path} read {got} bytes; the Hub's record of it says {size}")
        if sha256 and (digest := file_sha256(local)) != sha256:
            raise DamagedFile(
                f"{path} does not hash to the Hub's record of it (sha256 {digest[:12]}..., "
                f"the record names {sha256[:12]}...): the stored object is damaged"
            )
        return local

    @contextlib.contextmanager
    def local_copy(self, path: str, max_bytes: int | None = None) -> Iterator[Path]:
        """The downloaded file itself for the ``with`` block (retried, bounded by
        ``max_bytes`` on the file; removed afterwards), never read into memory here: the master
        reads a delta from it one tensor at a time. A missing file is ``RemoteNotFound``."""
        with tempfile.TemporaryDirectory(prefix="speedtronic-download-", dir=self.cache_dir) as tmp:
            yield self._run(f"download {path}", lambda: self._fetch(path, max_bytes, Path(tmp)))

    def _commit(
        self, additions: Mapping[str, bytes | Path], deletions: list[str], message: str
    ) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        with contextlib.ExitStack() as files:
            adds = {  # open files: read as they are sent, never through Xet
                path: CommitOperationAdd(
                    path_in_repo=path,
                    path_or_fileobj=files.enter_context(open(data, "rb"))
                    if isinstance(data, Path)
                    else io.BytesIO(data),
                )
                for path, data in additions.items()
            }
            staged = [adds[p] for p, data in additions.items() if isinstance(data, Path)]
            records = [adds[p] for p, data in additions.items() if not isinstance(data, Path)]
            for group in ([*records, *staged[:1]], *([op] for op in staged[1:])):
                if group:  # one staged file per call (see the module); records with the first
                    self.api.preupload_lfs_files(self.repo_id, additions=group, repo_type="model")
            deletes = [CommitOperationDelete(path_in_repo=path) for path in deletions]
            operations: list[CommitOperationAdd | CommitOperationDelete] = [
                *adds.values(),
                *deletes,
            ]
            self.api.create_commit(
                self.repo_id, operations=operations, commit_message=message, repo_type="model"
            )


def _quiet_bar() -> type:
    """A progress bar class that shows nothing (this store's downloads are logged, not drawn;
    the SDK's own setting is left alone)."""
    from huggingface_hub.utils.tqdm import tqdm

    class Quiet(tqdm):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # tqdm: no types

    return Quiet


HubTransport = HubClient
