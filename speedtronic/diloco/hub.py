"""Hugging Face Hub transport (``distributed.repo_id: owner/name``) on ``huggingface_hub.HfApi``.

Calls used (all checked against huggingface_hub 2.4.0): ``create_repo(private=True,
exist_ok=True)``, ``list_repo_tree(recursive=True)`` (paths and sizes),
``hf_hub_download(local_dir=...)`` (HEAD + GET on ``/resolve/``) and ``create_commit`` with
``CommitOperationAdd``/``CommitOperationDelete``: one commit per delta upload, and one commit
for publish + prune on the master. The endpoint comes from the ``endpoint`` argument, else
``HF_ENDPOINT`` read here in the constructor (never at import). The SDK's own retries are
switched off and each primitive call is bounded by ``request_timeout``
(:mod:`speedtronic.diloco.hub_http`), so :class:`RetryPolicy` is the one retry layer. The
token (stripped of surrounding whitespace) is handed to the SDK only; it is scrubbed from
every error message, and a 401/403 is a permanent error that says to check the token.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speedtronic.diloco.hub_http import hub_call, install_sdk_client
from speedtronic.diloco.transport import (
    GLOBAL_STEP,
    FileInfo,
    HubUnavailable,
    RepoTransport,
    RetryPolicy,
    TransportError,
)

__all__ = ["HubClient", "HubTransport", "install_sdk_timeouts"]

_LOG = logging.getLogger("speedtronic.diloco")
_POINTERS = frozenset({GLOBAL_STEP})  # read by every node at every poll
#: 2.1 name of :func:`speedtronic.diloco.hub_http.install_sdk_client`.
install_sdk_timeouts = install_sdk_client


def _auth_refused(exc: BaseException, repo_id: str, has_token: bool) -> TransportError | None:
    """A 401/403 from the Hub as a permanent error that says what to fix (never the token)."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status not in (401, 403):
        return None
    if not has_token:
        problem = "requires a token and none is configured"
    elif status == 401:
        problem = "rejected the token"
    else:
        problem = "refused access with this token (no write access to the repository?)"
    return TransportError(
        f"the Hub {problem} (HTTP {status}) for {repo_id}; check HF_TOKEN or the hf_token "
        "secret file",
        kind="permanent",
        status=status,
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
        self._api = api
        self._pointers: dict[str, tuple[str, bytes]] = {}  # path -> (etag, content)

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
                return fn(*args)
        except Exception as exc:
            refused = _auth_refused(exc, self.repo_id, bool(self._token))
            if refused is None:
                raise
            raise refused from None

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

    def _read(self, path: str) -> bytes:
        if path in _POINTERS:
            return self._read_pointer(path)
        return self._download(path)

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

    def _download(self, path: str) -> bytes:
        tmp = tempfile.mkdtemp(prefix="speedtronic-download-", dir=self.cache_dir)
        try:
            local = self.api.hf_hub_download(
                repo_id=self.repo_id,
                filename=path,
                local_dir=tmp,
                repo_type="model",
                token=self._token,
                force_download=True,
                etag_timeout=self.retry.timeout,
            )
            return Path(local).read_bytes()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _commit(self, additions: Mapping[str, bytes], deletions: list[str], message: str) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        operations: list[Any] = [
            CommitOperationAdd(path_in_repo=path, path_or_fileobj=io.BytesIO(data))
            for path, data in additions.items()
        ]
        operations += [CommitOperationDelete(path_in_repo=path) for path in deletions]
        self.api.create_commit(
            self.repo_id, operations=operations, commit_message=message, repo_type="model"
        )


HubTransport = HubClient
