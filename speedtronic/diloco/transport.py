"""Transport seam of DumbDiLoCo: errors, the shared retry policy, and the repository layout.

A transport owns five primitive operations on a repository of files (create, grant, list,
read, commit). :class:`RepoTransport` builds the DumbDiLoCo layout on top of them, so the Hub
(:mod:`speedtronic.diloco.hub`) and the shared volume (:mod:`speedtronic.diloco.directory`)
share one layout and one retry policy::

    global/latest.safetensors        full global state (native dtypes)
    global/step_count.json           version record (outer_step, sha256 of the weights, ...)
    global/processed.json            identities [node, step, base] the master has consumed
    nodes/<node_id>/delta_<step>.safetensors
    nodes/<node_id>/owner.json       claim of the live process using <node_id>

Every failure of a primitive is mapped to :class:`TransportError` in one place
(:func:`classify_error` + :meth:`RetryPolicy.run`); the messages never carry the token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any, Protocol, TypeVar

import torch

from speedtronic.diloco import tensors as T

__all__ = [
    "GLOBAL_MODEL",
    "GLOBAL_PROCESSED",
    "GLOBAL_STEP",
    "ErrorInfo",
    "GlobalMetadata",
    "HubError",
    "HubUnavailable",
    "RemoteNotFound",
    "RepoTransport",
    "RetryPolicy",
    "Transport",
    "TransportError",
    "build_transport",
    "classify_error",
    "retry_policy_from_config",
    "scrub",
]

GLOBAL_MODEL = "global/latest.safetensors"
GLOBAL_STEP = "global/step_count.json"
GLOBAL_PROCESSED = "global/processed.json"

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
    """Replace every secret (the Hub token) in ``text`` by ``<redacted>``."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "<redacted>")
    return text


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


@dataclasses.dataclass(frozen=True)
class GlobalMetadata:
    """Version record of the published global model (``global/step_count.json``)."""

    outer_step: int
    updated_at: str
    model_file: str = GLOBAL_MODEL
    sha256: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Core keys (sha256 only when known)."""
        out: dict[str, Any] = {
            "outer_step": self.outer_step,
            "updated_at": self.updated_at,
            "model_file": self.model_file,
        }
        if self.sha256:
            out["model_sha256"] = self.sha256
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GlobalMetadata:
        """Parse a record; the legacy key ``step`` is accepted for ``outer_step``."""
        return cls(
            outer_step=int(data.get("outer_step", data.get("step", 0))),
            updated_at=str(data.get("updated_at", "")),
            model_file=str(data.get("model_file", GLOBAL_MODEL)),
            sha256=str(data.get("model_sha256", "")),
        )


class Transport(Protocol):
    """What the coordinator and the outer loop need from a transport."""

    def create_repo(self, *, private: bool = True) -> None: ...
    def add_collaborator(self, username: str, permission: str = "write") -> None: ...
    def global_metadata(self) -> GlobalMetadata | None: ...
    def read_global(self, metadata: GlobalMetadata) -> dict[str, torch.Tensor]: ...
    def read_processed(self) -> list[tuple[str, int, int]]: ...
    def publish_global(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        outer_step: int,
        processed: Iterable[tuple[str, int, int]] = (),
        prune: Iterable[str] = (),
        metadata_extra: Mapping[str, object] | None = None,
    ) -> GlobalMetadata: ...
    def upload_delta(self, delta: Mapping[str, torch.Tensor], **kwargs: Any) -> tuple[str, int]: ...
    def delta_paths(self) -> list[str]: ...
    def read_delta(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]: ...
    def prune(self, paths: Iterable[str]) -> None: ...
    def read_owner(self, node_id: str) -> dict[str, Any] | None: ...
    def claim_owner(self, node_id: str, record: Mapping[str, Any]) -> None: ...


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")


class RepoTransport:
    """DumbDiLoCo layout over five primitives that subclasses implement.

    Subclasses implement ``_create_repo``, ``_grant``, ``_list``, ``_read`` (raise a
    not-found error for a missing file) and ``_commit(additions, deletions, message)``,
    which must apply all of its operations as one unit (one Hub commit).
    """

    kind = "abstract"

    def __init__(self, repo_id: str, retry: RetryPolicy | None = None):
        if not repo_id:
            raise ValueError("repo_id is required")
        self.repo_id = repo_id
        self.retry = retry or RetryPolicy()
        self.commits = 0  # commits issued by this process (Hub budget accounting)

    # -- primitives (subclasses) ---------------------------------------------------------
    def _create_repo(self, private: bool) -> None:
        raise NotImplementedError

    def _grant(self, username: str, permission: str) -> None:
        raise NotImplementedError

    def _list(self) -> list[str]:
        raise NotImplementedError

    def _read(self, path: str) -> bytes:
        raise NotImplementedError

    def _commit(self, additions: Mapping[str, bytes], deletions: list[str], message: str) -> None:
        raise NotImplementedError

    def _scoped(self, fn: Callable[..., R], *args: Any) -> R:
        """Run one primitive attempt (the Hub transport adds its request timeout here)."""
        return fn(*args)

    # -- retried primitives ----------------------------------------------------------------
    def create_repo(self, *, private: bool = True) -> None:
        """Create the repository (private by default); an existing one is accepted."""
        self.retry.run("create repository", lambda: self._scoped(self._create_repo, private))

    def add_collaborator(self, username: str, permission: str = "write") -> None:
        """Grant ``permission`` to ``username`` where the backend supports it."""
        if permission not in {"read", "write", "admin"}:
            raise ValueError("permission must be read, write, or admin")
        self.retry.run(
            f"grant {permission} access to {username}",
            lambda: self._scoped(self._grant, username, permission),
        )

    def list_files(self) -> list[str]:
        """Every file path in the repository, sorted."""
        return sorted(self.retry.run("list repository files", lambda: self._scoped(self._list)))

    def read_bytes(self, path: str) -> bytes | None:
        """Content of ``path``; None when it does not exist."""
        try:
            return self.retry.run(f"download {path}", lambda: self._scoped(self._read, path))
        except RemoteNotFound:
            return None

    def commit(
        self, additions: Mapping[str, bytes], deletions: Iterable[str] = (), message: str = "update"
    ) -> None:
        """Apply additions and deletions as one unit (one Hub commit)."""
        adds = dict(additions)
        dels = [p for p in dict.fromkeys(deletions) if p not in adds]
        if not adds and not dels:
            return
        try:
            self.retry.run(
                f"commit {message}", lambda: self._scoped(self._commit, adds, dels, message)
            )
        except RemoteNotFound:
            if not dels:
                raise
            # A deletion target is gone (e.g. a retried commit that had landed): drop those.
            present = set(self.list_files())
            dels = [p for p in dels if p in present]
            if not adds and not dels:
                return
            self.retry.run(
                f"commit {message}", lambda: self._scoped(self._commit, adds, dels, message)
            )
        self.commits += 1

    def file_exists(self, path: str) -> bool:
        """Whether ``path`` exists (a listing; cheap on small repos)."""
        return path in set(self.list_files())

    def read_json(self, path: str, *, default: Any = None) -> Any:
        """Decode a JSON file; ``default`` when absent. Bad JSON is a permanent TransportError."""
        data = self.read_bytes(path)
        if data is None:
            return default
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TransportError(f"{path} is not valid JSON: {exc}", kind="permanent") from None

    # -- layout ------------------------------------------------------------------------------
    def global_metadata(self) -> GlobalMetadata | None:
        """The published version record, or None before the bootstrap."""
        data = self.read_json(GLOBAL_STEP)
        if not isinstance(data, dict):
            return None
        return GlobalMetadata.from_dict(data)

    def read_global(self, metadata: GlobalMetadata | None = None) -> dict[str, torch.Tensor]:
        """Download and verify the global weights named by ``metadata``."""
        metadata = metadata or self.global_metadata()
        model_file = metadata.model_file if metadata else GLOBAL_MODEL
        if not (model_file.startswith("global/") and model_file.endswith(".safetensors")):
            raise TransportError(
                f"refusing model_file outside global/: {model_file}", kind="permanent"
            )
        data = self.read_bytes(model_file)
        if data is None:
            raise RemoteNotFound(f"{model_file} is missing")
        if metadata and metadata.sha256 and hashlib.sha256(data).hexdigest() != metadata.sha256:
            raise TransportError(
                f"{model_file} does not match step_count.json (changed while reading)"
            )
        try:
            return T.state_from_bytes(data)[0]
        except ValueError as exc:
            raise TransportError(f"{model_file} is corrupt: {exc}") from None

    def download_global(self, local_path: Any, metadata: GlobalMetadata | None = None) -> Any:
        """2.0.0 form: write the verified global weights to ``local_path`` and return it."""
        return T.save_safetensors(self.read_global(metadata), local_path)

    def read_processed(self) -> list[tuple[str, int, int]]:
        """The master's published processed-delta identities ``(node, step, base)``."""
        data = self.read_json(GLOBAL_PROCESSED, default={})
        items = data.get("processed", []) if isinstance(data, dict) else []
        return [(str(n), int(s), int(b)) for n, s, b in (i for i in items if len(i) == 3)]

    def publish_global(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        outer_step: int,
        processed: Iterable[tuple[str, int, int]] = (),
        prune: Iterable[str] = (),
        metadata_extra: Mapping[str, object] | None = None,
        updated_at: str | None = None,
    ) -> GlobalMetadata:
        """One commit: weights, processed set, version record (written in that order), and
        the deletion of consumed delta files."""
        weights = T.state_to_bytes(state)
        meta = GlobalMetadata(
            int(outer_step), updated_at or _now(), GLOBAL_MODEL, hashlib.sha256(weights).hexdigest()
        )
        record = {**{str(k): str(v) for k, v in (metadata_extra or {}).items()}, **meta.to_dict()}
        record["processed_file"] = GLOBAL_PROCESSED
        ledger = {"outer_step": int(outer_step), "processed": sorted([list(i) for i in processed])}
        additions = {
            GLOBAL_MODEL: weights,
            GLOBAL_PROCESSED: _json_bytes(ledger),
            GLOBAL_STEP: _json_bytes(record),
        }
        self.commit(additions, list(prune), message=f"outer step {int(outer_step)}")
        return meta

    def upload_delta(
        self,
        delta: Mapping[str, torch.Tensor],
        *,
        node_id: str,
        local_step: int,
        base_outer_step: int,
        dtype: str = "fp32",
        metadata: Mapping[str, object] | None = None,
        owner: Mapping[str, Any] | None = None,
        work_dir: Any = None,
    ) -> tuple[str, int]:
        """One commit per upload (plus the node's owner claim); returns ``(path, bytes)``."""
        del work_dir  # 2.0.0 staged files on disk; bytes go straight to the transport now
        path = T.delta_path(node_id, local_step)
        data = T.delta_to_bytes(
            delta,
            node_id=node_id,
            local_step=local_step,
            base_outer_step=base_outer_step,
            dtype=dtype,
            extra={k: v for k, v in (metadata or {}).items() if k != "algorithm"},
        )
        additions = {path: data}
        if owner is not None:
            additions[f"nodes/{node_id}/owner.json"] = _json_bytes(dict(owner))
        self.commit(additions, message=f"delta {node_id} step {int(local_step)}")
        return path, len(data)

    def delta_paths(self) -> list[str]:
        """Every well-formed delta path, sorted."""
        return [p for p in self.list_files() if T.parse_delta_path(p) is not None]

    def read_delta(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Download and parse one delta (float32 tensors). A damaged file is a ValueError."""
        data = self.read_bytes(path)
        if data is None:
            raise RemoteNotFound(f"{path} vanished")
        return T.delta_from_bytes(data)

    def prune(self, paths: Iterable[str]) -> None:
        """Delete consumed files in one commit."""
        self.commit({}, list(paths), message="prune consumed deltas")

    def read_owner(self, node_id: str) -> dict[str, Any] | None:
        """The claim file of ``node_id`` (None when absent or unreadable)."""
        try:
            data = self.read_json(f"nodes/{node_id}/owner.json")
        except TransportError as exc:
            if exc.kind == "permanent":
                return None
            raise
        return data if isinstance(data, dict) else None

    def claim_owner(self, node_id: str, record: Mapping[str, Any]) -> None:
        """Write the claim file of ``node_id`` (one commit)."""
        self.commit(
            {f"nodes/{node_id}/owner.json": _json_bytes(dict(record))}, message=f"claim {node_id}"
        )


def retry_policy_from_config(config: Any) -> RetryPolicy:
    """The shared policy from a ``distributed`` config section (the token is a secret)."""
    token = getattr(config, "token", None)
    return RetryPolicy(
        initial=float(getattr(config, "retry_initial", 1.0)),
        maximum=float(getattr(config, "retry_max", 60.0)),
        attempts=int(getattr(config, "retry_attempts", 6)),
        timeout=float(getattr(config, "request_timeout", 60.0) or 60.0),
        secrets=(token,) if token else (),
    )


def build_transport(config: Any, retry: RetryPolicy | None = None) -> Any:
    """``file:///abs`` -> DirectoryTransport; ``owner/name`` -> HubClient."""
    retry = retry or retry_policy_from_config(config)
    repo_id = str(getattr(config, "repo_id", "") or "")
    if repo_id.startswith("file:"):
        from speedtronic.diloco.directory import DirectoryTransport

        return DirectoryTransport(repo_id, retry)
    from speedtronic.diloco.hub import HubClient

    return HubClient(
        repo_id,
        token=getattr(config, "token", None),
        cache_dir=getattr(config, "cache_dir", None),
        retry=retry,
    )
