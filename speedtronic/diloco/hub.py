"""Hugging Face Hub transport (``distributed.repo_id: owner/name``) on ``huggingface_hub.HfApi``.

Calls used (all checked against huggingface_hub 2.4.0): ``create_repo(private=True,
exist_ok=True)``, ``list_repo_tree(recursive=True)`` (paths and sizes),
``hf_hub_download(local_dir=...)`` (HEAD + GET on ``/resolve/``) and ``create_commit`` with
``CommitOperationAdd``/``CommitOperationDelete``: one commit per delta upload, and one commit
for publish + prune on the master. The endpoint comes from the ``endpoint`` argument, else
``HF_ENDPOINT`` read here in the constructor (never at import). The SDK's own retries are
switched off and each primitive call is bounded by ``request_timeout``
(:mod:`speedtronic.diloco.hub_http`), so :class:`RetryPolicy` is the one retry layer. Files
the Hub answers ``lfs`` for (10 MiB and more) take the LFS path (batch endpoint, upload to the
storage URL it gives, pointer commit; downloads redirected to storage) through that same
client: Xet, which would move them outside it, is switched off for the process. The
token (stripped of surrounding whitespace) is handed to the SDK only; it is scrubbed from
every error message, and a 401/403 is a permanent error that says to check the token.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speedtronic.diloco.exchange import (
    GLOBAL_STEP,
    AccessRefused,
    FileInfo,
    HubUnavailable,
    RemoteNotFound,
    RepoTransport,
    RetryPolicy,
    TransportError,
    too_large,
)
from speedtronic.diloco.hub_http import hub_call, install_sdk_client

__all__ = ["HubClient", "HubTransport", "install_sdk_timeouts"]

_LOG = logging.getLogger("speedtronic.diloco")
_POINTERS = frozenset({GLOBAL_STEP})  # read by every node at every poll
#: 2.1 name of :func:`speedtronic.diloco.hub_http.install_sdk_client`.
install_sdk_timeouts = install_sdk_client


def _answer(exc: BaseException) -> tuple[int | None, bool]:
    """The HTTP status behind ``exc`` (the SDK wraps some, e.g. a forced download's failed
    HEAD in a ValueError) and whether the Hub said the repository itself is not found."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        status = getattr(getattr(current, "response", None), "status_code", None)
        if isinstance(status, int):
            names = {cls.__name__ for cls in type(current).__mro__}
            return status, "RepositoryNotFoundError" in names
        current = current.__cause__ or current.__context__
    return None, False


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


class HubClient(RepoTransport):
    """A Hub model repository used as the DumbDiLoCo rendezvous (private, one per run)."""

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
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
        retry_attempts: int = 6,
        request_timeout: float = 60.0,
        sleeper: Any = None,
        missing_repo_wait: float = 0.0,
    ):
        if retry is None:
            retry = RetryPolicy(retry_initial, retry_max, retry_attempts, request_timeout)
            if sleeper is not None:
                retry.sleeper = sleeper
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
        ``RemoteNotFound``). A 404 for a file is left alone (``RemoteNotFound``)."""
        status, repo_missing = _answer(exc)
        if status in (401, 403):
            return _auth_refused(status, self.repo_id, bool(self._token))
        if status != 404:
            return None
        if not repo_missing:  # a file is missing: the repository itself answered
            self._repo_seen = True
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
        """Download ``path``; with ``max_bytes``, a file the Hub lists as larger is refused
        before the download (one HEAD) and the downloaded file is checked before it is read."""
        if max_bytes is not None:
            from huggingface_hub import hf_hub_url

            url = hf_hub_url(self.repo_id, path, repo_type="model", endpoint=self.endpoint)
            size = self.api.get_hf_file_metadata(
                url=url, token=self._token, timeout=self.retry.timeout
            ).size
            if isinstance(size, int) and size > max_bytes:
                raise too_large(path, size, max_bytes)
        tmp = tempfile.mkdtemp(prefix="speedtronic-download-", dir=self.cache_dir)
        try:
            local = Path(
                self.api.hf_hub_download(
                    repo_id=self.repo_id,
                    filename=path,
                    local_dir=tmp,
                    repo_type="model",
                    token=self._token,
                    force_download=True,
                    etag_timeout=self.retry.timeout,
                )
            )
            size = local.stat().st_size
            if max_bytes is not None and size > max_bytes:
                raise too_large(path, size, max_bytes)
            return local.read_bytes()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

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


HubTransport = HubClient
