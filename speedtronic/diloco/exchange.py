"""The exchange every DiLoCo role meets through: its layout and the ``Store`` protocol that
the directory (:mod:`.directory`) and Hub (:mod:`.hub`) stores implement, with their errors
and one retry policy::

    global/latest.safetensors              global weights of outer step R (native dtypes)
    global/step_count.json                 version record (outer_step, sha256, run_id, final)
    global/processed.json                  ledger: per node, the highest round aggregated
                                           (and its final round, instance and digest)
    nodes/<node_id>/delta_<r>.safetensors  the node's contribution to round r
    nodes/<node_id>/owner.json             the node's claim and status (training/done)

What a contribution is, how its values are encoded (fp32, bf16, fp16, int8, int4), the format
of the files and the checks every file read passes are :mod:`.codec`'s.
A store adds a size bound, checked on the file actually read.

:class:`RepoTransport` builds the layout over five primitives a store implements (create,
grant, list, read, commit: one Hub commit, or temp file + rename per file on a volume). The one
reporting channel of every role is also here: a module logger ``speedtronic.diloco`` for lines,
and one structured :class:`Emit` ``emit(event, **fields)`` for events.

Every failure of a store's primitive is mapped to :class:`TransportError` in one place
(:func:`classify_error` + :meth:`RetryPolicy.run`): ``transient`` failures (outages, 5xx,
429, timeouts, dropped connections) are retried with exponential backoff, ``not_found`` and
``permanent`` ones (auth, bad request, programming errors) are not; a ``damaged`` file
(:class:`DamagedFile`: its bytes disagree with the store's record of them) is retried, then
``permanent``. Messages never carry the token (:func:`scrub`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar, runtime_checkable

import torch

from speedtronic.config import ConfigError, redaction
from speedtronic.config.limits import is_valid_node_id
from speedtronic.diloco.codec import (
    delta_from_bytes,
    first_non_finite,
    open_safetensors,
    save_safetensors,
    write_delta,
    write_safetensors,
)

__all__ = [
    "GLOBAL_MODEL",
    "GLOBAL_PROCESSED",
    "GLOBAL_STEP",
    "NODE_RECORDS",
    "AccessRefused",
    "DamagedFile",
    "Emit",
    "ErrorInfo",
    "ExchangeError",
    "FileInfo",
    "GlobalMetadata",
    "HubError",
    "HubUnavailable",
    "RemoteNotFound",
    "RepoScan",
    "RepoTransport",
    "RetryPolicy",
    "Store",
    "TornRead",
    "Transport",
    "TransportError",
    "classify_error",
    "delta_path",
    "file_sha256",
    "ignore",
    "max_global_bytes",
    "parse_delta_path",
    "retry_policy_from_config",
    "scrub",
    "too_large",
]

_LOG = logging.getLogger("speedtronic.diloco")


# -- errors and the one retry policy ---------------------------------------------------
class TransportError(RuntimeError):
    """A transport operation failed (after retries when the error was transient).

    ``kind`` is ``transient`` (outage, 5xx, 429, timeout), ``not_found``, ``permanent``
    (auth, bad request, unsupported) or ``damaged`` (:class:`DamagedFile`, while it is still
    retried); ``status`` is the HTTP status when there was one.
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


class DamagedFile(TransportError):
    """A file the store holds but cannot hand over whole and intact: the bytes read disagree
    with the size or hash of the store's own record of them (the Hub's LFS pointer), or the
    body is cut short or too long. Retried like an outage (a read may recover); once the
    retries are spent it is ``permanent``, and a reader refuses the file as it refuses any
    bad one (the master counts a contribution ``corrupt`` and prunes it)."""

    def __init__(self, message: str, *, kind: str = "damaged", status: int | None = None):
        super().__init__(message, kind=kind, status=status)


class HubUnavailable(TransportError):
    """Retries exhausted, or the SDK is missing."""


class RemoteNotFound(TransportError):
    """The remote file or repository does not exist."""

    def __init__(self, message: str, *, status: int | None = 404):
        super().__init__(message, kind="not_found", status=status)


class TornRead(TransportError):
    """The global's weights do not match ``step_count.json`` and are not newer than it: read
    while a publish was between its files (weights first, record last). Transient: the
    record that names these weights is on its way."""


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    """How the retry policy treats one exception."""

    kind: str  # transient | not_found | permanent | damaged (retried, then permanent)
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
                if info.kind == "damaged" and attempt >= attempts:  # the same every time
                    raise DamagedFile(
                        f"{operation} failed after {attempts} attempts: {text}",
                        kind="permanent",
                        status=info.status,
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


# -- reporting ---------------------------------------------------------------------------
class Emit(Protocol):
    """The one structured reporting channel: ``emit("event_name", field=value, ...)``.

    Event names and fields are a public contract (the Prometheus sink and docs/metrics.md
    read them); log lines go to the ``speedtronic.diloco`` logger instead."""

    def __call__(self, event: str, /, **fields: Any) -> None: ...


def ignore(event: str, /, **fields: Any) -> None:
    """An :class:`Emit` that reports nothing (the default where nobody listens)."""


# -- layout and the Store protocol --------------------------------------------------------
GLOBAL_MODEL = "global/latest.safetensors"
GLOBAL_STEP = "global/step_count.json"
GLOBAL_PROCESSED = "global/processed.json"
GLOBAL_UPDATE = "global/update.safetensors"  # the quantized outer update (global_dtype)
# the records of each node that global/processed.json carries beside the ledger, by type
NODE_RECORDS: dict[str, type] = {"finals": int, "instances": str, "digests": str, "dropped": str}

_DELTA_NAME = re.compile(r"^delta_(0|[1-9][0-9]*)\.safetensors$")


def is_path_safe(identifier: str) -> bool:
    """A node id by the one node-id rule of the config layer (letters, digits, ``._@+-``,
    starting with a letter or digit, at most 128 characters): a single path segment."""
    return is_valid_node_id(identifier)


def delta_path(node_id: str, round_index: int) -> str:
    """Remote path ``nodes/<node_id>/delta_<round>.safetensors`` of a node's contribution to
    round ``round_index`` (the outer step it is meant to update; 2.0.0 used the local step)."""
    return f"nodes/{node_id}/delta_{int(round_index)}.safetensors"


def parse_delta_path(path: str) -> tuple[str, int] | None:
    """``nodes/<node>/delta_<n>.safetensors`` -> ``(node, n)``; anything else -> None.

    Strict: the node must be path-safe and ``n`` a canonical non-negative integer.
    """
    parts = str(path).split("/")
    if len(parts) != 3 or parts[0] != "nodes" or not is_path_safe(parts[1]):
        return None
    match = _DELTA_NAME.match(parts[2])
    if match is None:
        return None
    return parts[1], int(match.group(1))


def max_global_bytes(like: Mapping[str, torch.Tensor]) -> int:
    """The largest global file a model shaped and typed as ``like`` can have (+ 1 MiB)."""
    return sum(v.numel() * v.element_size() for v in like.values()) + (1 << 20)


R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class GlobalMetadata:
    """Version record of the published global model (``global/step_count.json``).

    ``final`` is true on the global the master published after the last round of a run;
    ``run_id`` names the run (a new one each time a master starts a run from global 0), so
    a node can tell a new run from the next round and the master can refuse contributions
    computed in another run. ``update_sha256`` names the quantized outer update published
    with this global (``distributed.global_dtype``; :mod:`.master`).
    ``refused`` names the contributions (``node/round``) the master refused as unreadable
    or damaged since the previous global: how a node hears that its file was not used.
    """

    outer_step: int
    updated_at: str
    model_file: str = GLOBAL_MODEL
    sha256: str = ""
    final: bool = False
    run_id: str = ""
    update_sha256: str = ""
    refused: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Core keys (sha256 only when known, final only when true)."""
        out: dict[str, Any] = {
            "outer_step": self.outer_step,
            "updated_at": self.updated_at,
            "model_file": self.model_file,
        }
        if self.sha256:
            out["model_sha256"] = self.sha256
        if self.final:
            out["final"] = True
        if self.run_id:
            out["run_id"] = self.run_id
        if self.update_sha256:
            out["update_sha256"] = self.update_sha256
        if self.refused:
            out["refused"] = list(self.refused)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GlobalMetadata:
        """Parse a record; the legacy key ``step`` is accepted for ``outer_step``."""
        return cls(
            outer_step=int(data.get("outer_step", data.get("step", 0))),
            updated_at=str(data.get("updated_at", "")),
            model_file=str(data.get("model_file", GLOBAL_MODEL)),
            sha256=str(data.get("model_sha256", "")),
            final=str(data.get("final", "false")).lower() == "true",
            run_id=str(data.get("run_id", "")),
            update_sha256=str(data.get("update_sha256", "")),
            refused=_refused(data.get("refused")),
        )


def _refused(value: Any) -> tuple[str, ...]:
    """The well-formed ``node/round`` names of a record's ``refused`` list."""
    if not isinstance(value, list):
        return ()
    out = []
    for item in value:
        node, _, round = str(item).partition("/")
        if parse_delta_path(f"nodes/{node}/delta_{round}.safetensors") is not None:
            out.append(f"{node}/{round}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """What a listing says about one file: size in bytes and a version that changes when the
    content does (the Hub's blob id; size and mtime on a shared volume); None when unknown."""

    size: int | None = None
    version: str | None = None


@dataclasses.dataclass
class RepoScan:
    """One listing of the repository: contribution files and node records by node, and what
    the listing says about every file."""

    deltas: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)
    owners: set[str] = dataclasses.field(default_factory=set)
    files: dict[str, FileInfo] = dataclasses.field(default_factory=dict)

    def size(self, path: str) -> int | None:
        """The listed size of ``path`` (None: unknown)."""
        info = self.files.get(path)
        return info.size if info is not None else None


@runtime_checkable
class Store(Protocol):
    """The exchange as the node, the master, the relay and ``speedtronic eval`` use it: the
    layout above over a directory (:mod:`.directory`) or a Hub repository (:mod:`.hub`).

    Every call is retried by :attr:`retry` (transient failures only) and fails as a
    :class:`TransportError`: ``kind`` ``transient`` (an outage that outlived the retries),
    ``not_found`` (:class:`RemoteNotFound`) or ``permanent`` (a refused file, an access error
    (:class:`AccessRefused`), a misconfiguration); messages never carry the token.
    """

    #: ``directory`` or ``hub``.
    kind: str
    #: ``file:///abs/path`` or ``owner/name``.
    repo_id: str
    #: The one retry policy of this store (``on_retry`` may be set by the owner).
    retry: RetryPolicy
    #: Commits this process issued (Hub budget accounting).
    commits: int
    #: Size in bytes of the last contribution file this process uploaded.
    last_upload_bytes: int

    def create_repo(self, *, private: bool = True) -> None:
        """Create the exchange (private by default); an existing one is accepted."""
        ...

    def add_collaborator(self, username: str, permission: str = "write") -> None:
        """Grant ``permission`` (read, write, admin) to ``username`` where the backend can."""
        ...

    def list_info(self) -> dict[str, FileInfo]:
        """Every file of the exchange with its size and version (links never listed)."""
        ...

    def list_files(self) -> list[str]:
        """Every file path of the exchange, sorted."""
        ...

    def read_bytes(self, path: str, *, max_bytes: int | None = None) -> bytes | None:
        """The content of ``path``, None when it does not exist; longer than ``max_bytes``
        is a permanent error, checked on the bytes read."""
        ...

    def read_json(self, path: str, *, default: Any = None) -> Any:
        """``path`` decoded as JSON, ``default`` when absent; bad JSON is permanent."""
        ...

    def local_copy(
        self, path: str, max_bytes: int | None = None
    ) -> contextlib.AbstractContextManager[Path]:
        """A local file holding exactly the bytes of ``path`` for the ``with`` block, at most
        ``max_bytes`` long (checked on the file opened or downloaded, a permanent error);
        a missing file is :class:`RemoteNotFound`."""
        ...

    def commit(
        self,
        additions: Mapping[str, bytes | Path],
        deletions: Iterable[str] = (),
        message: str = "update",
    ) -> None:
        """Apply additions (in order; bytes, or a local file streamed from disk) and deletions
        as one unit: one Hub commit, or temp file + rename per file on a volume, so no
        reader sees half a file."""
        ...

    def global_metadata(self) -> GlobalMetadata | None:
        """The published version record (``global/step_count.json``), None before the
        bootstrap."""
        ...

    def fetch_global(
        self,
        metadata: GlobalMetadata | None = None,
        *,
        max_bytes: int | None = None,
        like: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[GlobalMetadata, dict[str, torch.Tensor]]:
        """The published weights, verified (checksum or the file's own header after a torn
        publish, size bound on the file read, keys, shapes and finiteness as installed into
        ``like``), with the record that describes them."""
        ...

    def read_global(self, metadata: GlobalMetadata | None = None) -> dict[str, torch.Tensor]:
        """The verified global weights (:meth:`fetch_global` without bounds)."""
        ...

    def read_ledger(self) -> dict[str, int]:
        """The published ledger: node id -> highest round already aggregated."""
        ...

    def read_node_records(self) -> dict[str, dict[str, Any]]:
        """What the published ledger's record says of each node beside its round:
        ``{"finals": ..., "instances": ..., "digests": ...}`` (empty maps when absent)."""
        ...

    def publish_global(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        outer_step: int,
        ledger: Mapping[str, int] | None = None,
        prune: Iterable[str] = (),
        metadata_extra: Mapping[str, object] | None = None,
        final: bool = False,
        run_id: str = "",
        node_records: Mapping[str, Mapping[str, object]] | None = None,
        update: Any = None,
        refused: Iterable[str] = (),
    ) -> GlobalMetadata:
        """One commit: weights, the quantized outer ``update`` if given, ledger (with
        ``node_records`` beside it) and version record (in that order; it names the
        ``refused`` contributions, ``node/round``) and the deletion of ``prune``; returns
        the record published."""
        ...

    def upload_delta(
        self,
        delta: Mapping[str, torch.Tensor],
        *,
        node_id: str,
        local_step: int,
        base_outer_step: int,
        round_index: int | None = None,
        dtype: str = "fp32",
        metadata: Mapping[str, object] | None = None,
        owner: Mapping[str, Any] | None = None,
        block_size: int | None = None,
    ) -> str:
        """One commit: the node's contribution to a round (and its status record when
        given) in wire format ``dtype`` (int8/int4: blocks of ``block_size`` values);
        returns the path, the size is left in :attr:`last_upload_bytes`."""
        ...

    def scan(self) -> RepoScan:
        """One listing: contributions by node and round, nodes with a record, file sizes."""
        ...

    def read_delta(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """One contribution as float32 tensors and its header (damage is a ValueError)."""
        ...

    def prune(self, paths: Iterable[str]) -> None:
        """Delete consumed files in one commit (files already gone are fine)."""
        ...

    def read_owner(self, node_id: str) -> dict[str, Any] | None:
        """The status record of ``node_id``; None when absent or unreadable."""
        ...

    def claim_owner(self, node_id: str, record: Mapping[str, Any]) -> None:
        """Write the status record of ``node_id`` (one commit)."""
        ...


#: 2.0.0 name of :class:`Store`.
Transport = Store


def too_large(path: str, size: int, max_bytes: int) -> TransportError:
    """The permanent refusal of a file past its size bound (checked on what is read)."""
    return TransportError(
        f"{path} is {size} bytes, more than the {max_bytes} bytes allowed for it (a file from "
        "another model, or damaged); refusing it unread",
        kind="permanent",
    )


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _own_record(
    header: Mapping[str, str], record: GlobalMetadata, digest: str
) -> GlobalMetadata | None:
    """The global file's own description when it is at least as new as ``record``."""
    try:
        step = int(header["outer_step"])
    except (KeyError, ValueError):
        return None
    if step < record.outer_step:
        return None
    return GlobalMetadata(
        step,
        record.updated_at,
        record.model_file,
        digest,
        header.get("final", "False") == "True",
        header.get("run_id", ""),
    )


def _check_like(
    where: str, state: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]
) -> None:
    """A global must hold exactly the model's keys with its shapes (permanent refusal)."""
    missing = sorted(set(like) - set(state))
    extra = sorted(set(state) - set(like))
    if missing or extra:
        raise TransportError(
            f"{where} does not match the model: missing {missing[:5]}, unexpected "
            f"{extra[:5]} (a global of another model; check model settings on every node)",
            kind="permanent",
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(like[key].shape):
            raise TransportError(
                f"{where} does not match the model: {key} has shape {tuple(value.shape)}, "
                f"the model {tuple(like[key].shape)}",
                kind="permanent",
            )


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
        self.staging_dir: Path | None = None  # where uploads are staged (None: the temp dir)
        self.last_upload_bytes = 0  # size of the last delta file this process uploaded

    # -- primitives (subclasses) ---------------------------------------------------------
    def _create_repo(self, private: bool) -> None:
        raise NotImplementedError

    def _grant(self, username: str, permission: str) -> None:
        raise NotImplementedError

    def _list(self) -> dict[str, FileInfo]:
        raise NotImplementedError

    def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        raise NotImplementedError

    def _commit(
        self, additions: Mapping[str, bytes | Path], deletions: list[str], message: str
    ) -> None:
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

    def list_info(self) -> dict[str, FileInfo]:
        """Every file path in the repository with its size and version."""
        return dict(self.retry.run("list repository files", lambda: self._scoped(self._list)))

    def list_files(self) -> list[str]:
        """Every file path in the repository, sorted."""
        return sorted(self.list_info())

    @contextlib.contextmanager
    def local_copy(self, path: str, max_bytes: int | None = None) -> Iterator[Path]:
        """A local file holding ``path`` (retried download; removed afterwards), at most
        ``max_bytes`` long (checked on the downloaded file: a permanent ``TransportError``).
        A missing file is ``RemoteNotFound``."""
        data = self.read_bytes(path, max_bytes=max_bytes)
        if data is None:
            raise RemoteNotFound(f"{path} vanished")
        with tempfile.TemporaryDirectory(prefix="speedtronic-read-") as tmp:
            local = Path(tmp) / "file.safetensors"
            local.write_bytes(data)
            del data
            yield local

    def read_bytes(self, path: str, *, max_bytes: int | None = None) -> bytes | None:
        """Content of ``path``; None when it does not exist. A file longer than ``max_bytes``
        is a permanent ``TransportError`` (the bound holds on the bytes read)."""
        try:
            return self.retry.run(
                f"download {path}", lambda: self._scoped(self._read, path, max_bytes)
            )
        except RemoteNotFound:
            return None

    def commit(
        self,
        additions: Mapping[str, bytes | Path],
        deletions: Iterable[str] = (),
        message: str = "update",
    ) -> None:
        """Apply additions (bytes, or a local file read as it is sent) and deletions as one
        unit (one Hub commit)."""
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
        """Download and verify the global weights named by ``metadata`` (see
        :meth:`fetch_global`, which also bounds the size and repairs a torn publish)."""
        return self.fetch_global(metadata)[1]

    def fetch_global(
        self,
        metadata: GlobalMetadata | None = None,
        *,
        max_bytes: int | None = None,
        like: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[GlobalMetadata, dict[str, torch.Tensor]]:
        """The verified global and the record that describes it.

        ``max_bytes`` refuses a file larger than that (checked on the file read). The weights
        must match ``step_count.json``'s checksum; when they do not, the file's own header
        (outer step, run id, written by :meth:`publish_global`) is trusted if it is at least
        as new as the record: a publish torn between its files. With ``like`` (the model's
        state), the global must hold exactly its keys with its shapes, and every floating
        tensor must be finite as it will be installed (cast to ``like``'s dtype); without it,
        finite in the file's dtype. Refusals are permanent ``TransportError``s.
        """
        metadata = metadata or self.global_metadata()
        if metadata is None:
            raise RemoteNotFound(f"{GLOBAL_STEP} is missing")
        model_file = metadata.model_file
        if not (model_file.startswith("global/") and model_file.endswith(".safetensors")):
            raise TransportError(
                f"refusing model_file outside global/: {model_file}", kind="permanent"
            )
        try:  # the file read as it lies on disk: its bytes are never all in memory at once
            with self.local_copy(model_file, max_bytes=max_bytes) as local:
                digest = file_sha256(local)
                with open_safetensors(local) as opened:
                    header = opened.metadata()
                    state = {key: opened.get_tensor(key) for key in opened}
        except RemoteNotFound:
            raise RemoteNotFound(f"{model_file} is missing") from None
        except ValueError as exc:
            raise TransportError(f"{model_file} is corrupt: {exc}") from None
        if metadata.sha256 and digest != metadata.sha256:
            own = _own_record(header, metadata, digest)
            if own is None:
                raise TornRead(
                    f"{model_file} does not match step_count.json (changed while reading)"
                )
            metadata = own
        where = f"{model_file} (outer step {metadata.outer_step})"
        if like is not None:
            _check_like(where, state, like)
        bad = first_non_finite(state, like=like)
        if bad is not None:
            cast = like is not None and bad in like and like[bad].dtype != state[bad].dtype
            after = f" after the cast to the model's {like[bad].dtype}" if cast else ""
            raise TransportError(
                f"{where} holds non-finite values in {bad}{after}; refusing it",
                kind="permanent",
            )
        return metadata, state

    def download_global(self, local_path: Any, metadata: GlobalMetadata | None = None) -> Any:
        """2.0.0 form: write the verified global weights to ``local_path`` and return it."""
        return save_safetensors(self.read_global(metadata), local_path)

    def read_ledger(self) -> dict[str, int]:
        """The master's published ledger: node id -> highest round already aggregated.

        A ledger in another format (2.0.0 wrote a list of consumed files) reads as empty.
        """
        data = self.read_json(GLOBAL_PROCESSED, default={})
        nodes = data.get("nodes") if isinstance(data, dict) else None
        if not isinstance(nodes, dict):
            return {}
        ledger: dict[str, int] = {}
        for node, value in nodes.items():
            if is_path_safe(str(node)) and isinstance(value, int) and not isinstance(value, bool):
                ledger[str(node)] = value
        return ledger

    def read_node_records(self) -> dict[str, dict[str, Any]]:
        """The master's published records of each node beside the ledger: ``finals`` (node
        -> round of its aggregated contribution flagged final), ``instances`` (node -> the
        instance of its last aggregated contribution), ``digests`` (node -> its sha256) and
        ``dropped`` (node -> the instance the master no longer waits for).
        A record written before they were published reads as empty maps."""
        data = self.read_json(GLOBAL_PROCESSED, default={})
        records: dict[str, dict[str, Any]] = {}
        for name, kind in NODE_RECORDS.items():
            found = data.get(name) if isinstance(data, dict) else None
            records[name] = {
                str(node): value
                for node, value in (found if isinstance(found, dict) else {}).items()
                if is_path_safe(str(node))
                and isinstance(value, kind)
                and not isinstance(value, bool)
            }
        return records

    def publish_global(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        outer_step: int,
        ledger: Mapping[str, int] | None = None,
        prune: Iterable[str] = (),
        metadata_extra: Mapping[str, object] | None = None,
        final: bool = False,
        run_id: str = "",
        node_records: Mapping[str, Mapping[str, object]] | None = None,
        updated_at: str | None = None,
        work_dir: Any = None,
        update: Any = None,
        refused: Iterable[str] = (),
    ) -> GlobalMetadata:
        """One commit: weights, the quantized outer ``update`` (an
        :class:`~speedtronic.diloco.master.OuterUpdate`) if given, ledger, version record
        (written in that order; it names the ``refused`` contributions, ``node/round``), and
        the deletion of consumed delta files. ``work_dir`` is accepted for 2.0.0 callers and
        unused (the bytes go straight to the transport)."""
        del work_dir
        header = {"outer_step": int(outer_step), "run_id": str(run_id), "final": bool(final)}
        with contextlib.ExitStack() as stack:
            weights, handle = stack.enter_context(self._staged("latest.safetensors"))
            sha256 = write_safetensors(handle, state, metadata=header)
            handle.close()
            files = {GLOBAL_MODEL: weights}
            update_sha256 = ""
            if update is not None:
                path, handle = stack.enter_context(self._staged("update.safetensors"))
                update_sha256 = update.write(handle)
                handle.close()
                files[GLOBAL_UPDATE] = path
            stamp = updated_at or _now()
            meta = GlobalMetadata(
                int(outer_step),
                stamp,
                GLOBAL_MODEL,
                sha256,
                bool(final),
                str(run_id),
                update_sha256,
                tuple(refused),
            )
            self._publish(meta, files, ledger, prune, metadata_extra, node_records)
        return meta

    @contextlib.contextmanager
    def _staged(self, name: str) -> Iterator[tuple[Path, BinaryIO]]:
        """A local file to write an upload into (under :attr:`staging_dir`), removed after."""
        with tempfile.TemporaryDirectory(prefix="speedtronic-stage-", dir=self.staging_dir) as tmp:
            path = Path(tmp) / name
            with open(path, "wb") as handle:
                yield path, handle

    def _publish(
        self,
        meta: GlobalMetadata,
        files: Mapping[str, Path],
        ledger: Mapping[str, int] | None,
        prune: Iterable[str],
        metadata_extra: Mapping[str, object] | None,
        node_records: Mapping[str, Mapping[str, object]] | None,
    ) -> None:
        """The commit of :meth:`publish_global`: weights (and update: staged files), ledger,
        record."""
        outer_step = meta.outer_step
        record = {**{str(k): str(v) for k, v in (metadata_extra or {}).items()}, **meta.to_dict()}
        record["processed_file"] = GLOBAL_PROCESSED
        book: dict[str, Any] = {
            "outer_step": int(outer_step),
            "nodes": dict(sorted((ledger or {}).items())),
        }
        for name, values in (node_records or {}).items():
            if name in NODE_RECORDS:  # what the master knows of each node, beside its round
                book[name] = dict(sorted(values.items()))
        additions = {
            **files,
            GLOBAL_PROCESSED: _json_bytes(book),
            GLOBAL_STEP: _json_bytes(record),
        }
        self.commit(additions, list(prune), message=f"outer step {int(outer_step)}")

    def upload_delta(
        self,
        delta: Mapping[str, torch.Tensor],
        *,
        node_id: str,
        local_step: int,
        base_outer_step: int,
        round_index: int | None = None,
        dtype: str = "fp32",
        metadata: Mapping[str, object] | None = None,
        owner: Mapping[str, Any] | None = None,
        work_dir: Any = None,
        block_size: int | None = None,
    ) -> str:
        """Upload a node's contribution to round ``round_index`` (default: the base outer
        step) as ``nodes/<node>/delta_<round>.safetensors`` in one commit, with the node's
        owner record when given, in wire format ``dtype`` (int8/int4: blocks of
        ``block_size`` values; the values may be given already quantized, see
        :func:`.codec.encode_delta`). Returns the remote path; the size in bytes is left in
        :attr:`last_upload_bytes`."""
        del work_dir  # 2.0.0's own staging directory; the store stages the file itself
        target = int(base_outer_step if round_index is None else round_index)
        path = delta_path(node_id, target)
        with self._staged("delta.safetensors") as (staged, handle):
            write_delta(  # one tensor at a time: never the whole file in memory
                handle,
                delta,
                node_id=node_id,
                local_step=local_step,
                base_outer_step=base_outer_step,
                round_index=target,
                dtype=dtype,
                extra={k: v for k, v in (metadata or {}).items() if k != "algorithm"},
                block_size=block_size,
            )
            handle.close()
            additions: dict[str, bytes | Path] = {path: staged}
            if owner is not None:
                additions[f"nodes/{node_id}/owner.json"] = _json_bytes(dict(owner))
            self.commit(additions, message=f"delta {node_id} round {target}")
            self.last_upload_bytes = staged.stat().st_size
        return path

    def scan(self) -> RepoScan:
        """One listing: contributions ``{node: {round: path}}``, the nodes with a record, and
        every file's size."""
        scan = RepoScan(files=self.list_info())
        for path in sorted(scan.files):
            parsed = parse_delta_path(path)
            if parsed is not None:
                scan.deltas.setdefault(parsed[0], {})[parsed[1]] = path
                continue
            parts = path.split("/")
            owner = len(parts) == 3 and parts[0] == "nodes" and parts[2] == "owner.json"
            if owner and is_path_safe(parts[1]):
                scan.owners.add(parts[1])
        return scan

    def delta_paths(self) -> list[str]:
        """Every well-formed delta path, sorted."""
        return [p for p in self.list_files() if parse_delta_path(p) is not None]

    def read_delta(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Download and parse one delta (float32 tensors). A damaged file is a ValueError."""
        data = self.read_bytes(path)
        if data is None:
            raise RemoteNotFound(f"{path} vanished")
        return delta_from_bytes(data)

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
