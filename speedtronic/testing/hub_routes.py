"""HTTP routes of the Hub emulator (:mod:`.hub_server`): one request handler that speaks the
endpoints huggingface_hub uses, its access rules and fault points, and the large-file path
(storage logic in :mod:`.hub_lfs`). State and knobs live on :class:`~.hub_server.HubEmulator`.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import re
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

from speedtronic.json_types import JSON
from speedtronic.testing.hub_lfs import git_blob_oid, json_body, lfs_pointer

if TYPE_CHECKING:
    from speedtronic.testing.hub_server import HubEmulator, HubHTTPServer

__all__ = ["HubHandler", "Repo", "endpoint_kind"]

Query = dict[str, list[str]]
"""A URL's query string as ``parse_qs`` reads it: each name with its values in order."""

# A dataset repo is held under the key ``datasets/<owner>/<name>`` (a model repo: ``owner/name``),
# which is also how its resolve and large-file URLs spell it.
_API = re.compile(
    r"^/api/(models|datasets)/([^/]+/[^/]+)/(revision|tree|preupload|commit)/([^/]+)(/.*)?$"
)
_INFO = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)$")
_RESOLVE = re.compile(r"^/((?:datasets/)?[^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_LFS = re.compile(r"^/((?:datasets/)?[^/]+/[^/]+)\.git/info/lfs/objects/(batch|verify)$")
_COMPLETE = re.compile(r"^/_lfs/complete/([0-9a-f]{64})$")
_STORAGE = re.compile(r"^/lfs-objects/(.+)$")
_XET = re.compile(r"^/api/models/[^/]+/[^/]+/xet-")


@dataclasses.dataclass
class Repo:
    private: bool
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    lfs: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> object id (sha256)
    sha: str = "0" * 40
    commits: int = 0


def endpoint_kind(path: str, method: str = "GET") -> str:
    """Endpoint kind of a request path: create, whoami, tree, commit, resolve, lfs-batch,
    storage-upload, storage-download, xet, ..."""
    path = unquote(path)
    match = _API.match(path)
    if match:
        return match.group(3)
    if _RESOLVE.match(path):
        return "resolve"
    if _STORAGE.match(path):
        return "storage-upload" if method == "PUT" else "storage-download"
    lfs = _LFS.match(path)
    if lfs:
        return f"lfs-{lfs.group(2)}"
    if _COMPLETE.match(path):
        return "lfs-complete"
    if _XET.match(path):
        return "xet"
    if path == "/api/repos/create":
        return "create"
    if path.startswith("/api/whoami"):
        return "whoami"
    return path.strip("/").replace("/", "_") or "root"


def _repo_key(kind: str, repo_id: str) -> str:
    """The emulator's key of a repo named in an API path (``models`` or ``datasets``)."""
    return f"datasets/{repo_id}" if kind == "datasets" else repo_id


class HubHandler(BaseHTTPRequestHandler):
    server_version = "SpeedtronicHubEmulator/1.0"
    protocol_version = "HTTP/1.1"
    server: HubHTTPServer  # the origin that accepted this request

    def log_message(self, format: str, *args: object) -> None:  # quiet
        return

    @property
    def hub(self) -> HubEmulator:
        return self.server.hub

    # -- plumbing ---------------------------------------------------------------------------
    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    @property
    def _on_storage(self) -> bool:
        """Whether this request arrived on the storage origin (not the Hub's)."""
        return self.server.storage

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        head: bool = False,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _json(
        self, status: int, value: Any, headers: dict[str, str] | None = None, head: bool = False
    ) -> None:
        self._send(status, json.dumps(value).encode(), headers, head)

    def _error(
        self,
        status: int,
        message: str,
        code: str | None = None,
        extra: dict[str, str] | None = None,
        head: bool = False,
    ) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers, head)

    def _fault(self, download: bool, kind: str) -> str | None:
        """Decide (under the lock) whether this request fails, and how."""
        if self.path.startswith("/_emulator"):
            return None
        fault = self.hub.draw_fault(download, kind)
        if fault == "slow":
            time.sleep(self.hub.faults.slow_seconds)
            return None
        if fault == "drop":
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(2)
            return "dropped"
        head = self.command == "HEAD"  # a HEAD answer must not carry a body
        if fault == "error":
            self._error(503, "injected server error", head=head)
            return "error"
        if fault == "rate_limit":
            self._error(
                429,
                "injected rate limit",
                extra={"Retry-After": f"{self.hub.faults.retry_after:g}"},
                head=head,
            )
            return "rate_limit"
        return fault  # "truncate" or None

    def _caller(self) -> str:
        """The bearer token of this request ('' when none)."""
        header = self.headers.get("Authorization", "")
        return header[len("Bearer ") :] if header.startswith("Bearer ") else ""

    def _authorised(self, repo: Repo | None) -> bool:
        """Whether the caller sees repositories (a read-only token does, and may not write)."""
        if not self.hub.tokens:
            return True
        return self._caller() in self.hub.tokens | self.hub.read_only_tokens

    def _may_write(self) -> bool:
        """False (after a 403 answer) for a read-only token."""
        if self._caller() not in self.hub.read_only_tokens:
            return True
        self._error(403, "You don't have the rights to write to this repository", "Forbidden")
        return False

    # -- verbs --------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        body = self._body() if method in ("POST", "PUT") else b""
        kind = endpoint_kind(path, method)
        resolve = None if self._on_storage else _RESOLVE.match(path)
        download = method == "GET" and (bool(resolve) or kind == "storage-download")
        fault = self._fault(download, kind)
        if fault in ("dropped", "error", "rate_limit"):
            return
        if self._on_storage:
            self.hub.delay()
            self.hub.count(method, path)
            return self._storage(method, path, query, body, truncate=fault == "truncate")
        if not path.startswith("/_emulator"):
            self.hub.delay()
            over = self.hub.budget.request(self._caller())
            if over is not None:
                self.hub.count(method, "budget:requests")
                return self._error(429, "API request quota exceeded", extra=over)
        self.hub.count(method, path)
        self.hub.tally(self._caller(), "requests")
        if self._caller() in self.hub.refused_tokens and not path.startswith("/_emulator"):
            return self._error(
                401, "Invalid credentials in Authorization header", head=method == "HEAD"
            )
        if path == "/_emulator/stats":
            return self._json(200, self.hub.stats())
        if path == "/_emulator/faults" and method == "POST":
            self.hub.set_faults(**json.loads(body or b"{}"))
            return self._json(200, dataclasses.asdict(self.hub.faults))
        if path == "/api/repos/create" and method == "POST":
            return self._create(body)
        if path == "/api/validate-yaml" and method == "POST":  # a README's metadata block
            return self._json(200, {"errors": [], "warnings": []})
        if path == "/api/whoami-v2":
            if not self._authorised(None):
                return self._error(401, "Invalid credentials in Authorization header")
            return self._json(200, {"type": "user", "name": "emulator", "auth": {}})
        info = _INFO.match(path)
        if info and method == "GET":
            return self._api(method, _repo_key(*info.groups()), "revision", "", query, body)
        match = _API.match(path)
        if match:
            kind, repo_id, action, _rev, rest = match.groups()
            repo_id = _repo_key(kind, repo_id)
            return self._api(method, repo_id, action, (rest or "").lstrip("/"), query, body)
        if resolve:
            repo_id, _rev, file_path = resolve.groups()
            return self._resolve(method, repo_id, file_path, truncate=fault == "truncate")
        lfs = _LFS.match(path)
        if lfs and method == "POST":
            return self._lfs(lfs.group(1), lfs.group(2), body)
        complete = _COMPLETE.match(path)
        if complete and method == "POST":
            sig = query.get("sig", [""])[0]
            return self._answer(self.hub.lfs.complete(complete.group(1), sig, json_body(body)))
        self._error(404, f"no route for {method} {path}", head=method == "HEAD")

    # -- the large-file path (storage logic in hub_lfs) ---------------------------------------
    def _answer(self, answer: tuple[int, Any, dict[str, str]], head: bool = False) -> None:
        status, value, headers = answer
        if isinstance(value, bytes):
            return self._send(status, value, headers, head, "application/octet-stream")
        self._json(status, value, headers, head)

    def _lfs(self, repo_id: str, action: str, body: bytes) -> None:
        repo = self._repo_or_404(repo_id)
        if repo is None or (action == "batch" and not self._may_write()):
            return
        request = json_body(body)
        lfs = self.hub.lfs
        self._answer(lfs.batch(repo_id, request) if action == "batch" else lfs.verify(request))

    def _storage(self, method: str, path: str, query: Query, body: bytes, truncate: bool) -> None:
        head = method == "HEAD"
        if self.headers.get("Authorization"):  # the Hub token must never leave the Hub
            self.hub.count(method, "storage:auth")
            return self._error(400, "InvalidArgument: only one auth mechanism allowed", head=head)
        match = _STORAGE.match(path)
        if match is None:
            return self._error(404, "NoSuchKey", head=head)
        found = self.hub.lfs.storage(method, match.group(1), query.get("sig", [""])[0], body)
        if isinstance(found, bytes):
            etag = f'"{match.group(1)}"'
            return self._payload(found, {"ETag": etag, "Accept-Ranges": "bytes"}, head, truncate)
        self._answer(found, head=head)

    def _repo_or_404(self, repo_id: str, head: bool = False) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or not self._authorised(repo):
            self._error(404, "Repository not found", "RepoNotFound", head=head)
            return None
        return repo

    def _create(self, body: bytes) -> None:
        if not self._authorised(None):
            return self._error(401, "Invalid credentials in Authorization header")
        if not self._may_write():
            return None
        data = json.loads(body or b"{}")
        name, org = data.get("name"), data.get("organization")
        repo_id = f"{org}/{name}" if org else f"emulator/{name}"
        if data.get("type") == "dataset":
            repo_id = f"datasets/{repo_id}"
        private = (
            data.get("visibility", "private" if data.get("private") else "public") == "private"
        )
        with self.hub.lock:
            if repo_id in self.hub.repos:
                return self._json(
                    409,
                    {
                        "error": "You already created this model repo",
                        "url": f"{self.hub.url}/{repo_id}",
                    },
                    {"X-Error-Message": "You already created this model repo"},
                )
            self.hub.repos[repo_id] = repo = Repo(private=private)
            attributes = self.hub.lfs.config.gitattributes
            if attributes:  # what a new repository holds on the Hub (not counted as a commit)
                repo.files[".gitattributes"] = attributes.encode()
        self._json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def _api(
        self, method: str, repo_id: str, action: str, rest: str, query: Query, body: bytes
    ) -> None:
        repo = self._repo_or_404(repo_id)
        if repo is None:
            return
        if action == "revision" and method == "GET":
            with self.hub.lock:
                return self._json(
                    200,
                    {
                        "id": repo_id.removeprefix("datasets/"),
                        "modelId": repo_id.removeprefix("datasets/"),
                        "sha": repo.sha,
                        "private": repo.private,
                        "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                    },
                )
        if action == "tree" and method == "GET":
            return self._tree(repo, rest, query)
        if action == "preupload" and method == "POST":
            files = json.loads(body or b"{}").get("files", [])
            mode = self.hub.lfs.upload_mode
            with self.hub.lock:
                attributes = repo.files.get(".gitattributes", b"").decode("utf-8", "replace")
            return self._json(
                200,
                {
                    "files": [
                        {
                            "path": f["path"],
                            "uploadMode": mode(f["path"], int(f.get("size") or 0), attributes),
                            "shouldIgnore": False,
                        }
                        for f in files
                    ]
                },
            )
        if action == "commit" and method == "POST":
            return self._commit(repo_id, repo, body)
        self._error(405, f"{method} not supported on {action}")

    def _tree(self, repo: Repo, prefix: str, query: Query) -> None:
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = prefix.strip("/")
        base = f"{prefix}/" if prefix else ""
        with self.hub.lock:
            files = {p: d for p, d in repo.files.items() if p.startswith(base)}
            lfs = {p: oid for p, oid in repo.lfs.items() if p in files}
        if prefix and not files:
            return self._error(404, f"{prefix} does not exist", "EntryNotFound")
        entries, dirs = [], set()
        for path, data in sorted(files.items()):
            rel = path[len(base) :]
            parts = rel.split("/")
            for i in range(1, len(parts)):
                if recursive or i == 1:
                    dirs.add(base + "/".join(parts[:i]))
            if recursive or len(parts) == 1:
                entry: JSON = {
                    "type": "file",
                    "path": path,
                    "size": len(data),
                    "oid": hashlib.sha1(data).hexdigest(),
                }
                if path in lfs:  # as the Hub lists it: the blob is the pointer
                    pointer = lfs_pointer(lfs[path], len(data))
                    entry["oid"] = git_blob_oid(pointer)
                    entry["lfs"] = {
                        "oid": lfs[path],
                        "size": len(data),
                        "pointerSize": len(pointer),
                    }
                entries.append(entry)
        entries += [
            {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
            for d in sorted(dirs)
        ]
        self._json(200, entries)

    def _commit(self, repo_id: str, repo: Repo, body: bytes) -> None:
        if not self._may_write():
            return
        over = self.hub.budget.commit(repo_id, self._caller())
        if over is not None:
            self.hub.count("POST", "budget:commits")
            return self._error(
                429, "You have exceeded our hourly quotas for action: commit", extra=over
            )
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except json.JSONDecodeError:
            return self._error(400, "malformed NDJSON commit payload")
        adds: dict[str, bytes] = {}
        pointers: dict[str, str] = {}  # path -> object id, for lfsFile entries
        deletes: list[str] = []
        for item in lines:
            key, value = item.get("key"), item.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    return self._error(400, "only base64 file entries are supported")
                adds[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value.get("algo", "sha256") != "sha256":
                    return self._error(400, "only sha256 LFS pointers are supported")
                data = self.hub.lfs.stored(str(value.get("oid")), value.get("size"))
                if data is None:
                    return self._error(
                        422, f"LFS object of {value.get('path')} was not uploaded", "LfsNotFound"
                    )
                adds[value["path"]], pointers[value["path"]] = data, value["oid"]
            elif key == "deletedFile":
                deletes.append(value["path"])
            elif key == "deletedFolder":
                deletes.append(value["path"].rstrip("/") + "/")
        with self.hub.lock:
            for path in deletes:
                if path.endswith("/"):
                    continue
                if path not in repo.files and path not in adds:
                    return self._error(404, "A file with this name doesn't exist", "EntryNotFound")
            before = set(repo.lfs.values())
            for path, data in adds.items():
                repo.files[path] = data
                if path in pointers:
                    repo.lfs[path] = pointers[path]
                else:
                    repo.lfs.pop(path, None)
            for path in deletes:
                if path.endswith("/"):
                    for p in [p for p in repo.files if p.startswith(path)]:
                        del repo.files[p]
                        repo.lfs.pop(p, None)
                elif path not in adds:
                    repo.files.pop(path, None)
                    repo.lfs.pop(path, None)
            live = {oid for other in self.hub.repos.values() for oid in other.lfs.values()}
            self.hub.lfs.keep(pointers.values())
            self.hub.lfs.release(before - live)  # objects no file points to any more
            repo.commits += 1
            self.hub.commits += 1
            self.hub.tally(self._caller(), "commits")
            repo.sha = hashlib.sha1(f"{repo_id}:{repo.commits}:{time.time()}".encode()).hexdigest()
            sha = repo.sha
            if self.hub.on_commit is not None:  # under the lock: counters exact at this commit
                self.hub.on_commit(repo_id, adds)
        self._json(
            200,
            {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{self.hub.url}/{repo_id}/commit/{sha}",
            },
        )

    def _resolve(self, method: str, repo_id: str, path: str, truncate: bool) -> None:
        head = method == "HEAD"
        repo = self._repo_or_404(repo_id, head=head)
        if repo is None:
            return
        with self.hub.lock:
            data = repo.files.get(path)
            oid = repo.lfs.get(path)
            sha = repo.sha
        if data is None:
            return self._error(
                404, "Entry not found", "EntryNotFound", extra={"X-Repo-Commit": sha}, head=head
            )
        if oid is not None:  # an LFS file: the Hub redirects to storage
            return self._send(
                302, b"", self.hub.lfs.redirect(repo_id, oid, len(data), sha), head=head
            )
        headers = {
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "X-Repo-Commit": sha,
            "Accept-Ranges": "bytes",
        }
        self._payload(data, headers, head, truncate)

    def _payload(self, data: bytes, headers: dict[str, str], head: bool, truncate: bool) -> None:
        """Serve ``data`` (a ``Range: bytes=N-`` from N on), cut in half when ``truncate``."""
        headers = dict(headers)
        status, start = 200, 0
        ranged = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
        if ranged and not head and int(ranged.group(1)) < len(data):
            start = int(ranged.group(1))
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        payload = data[start:]
        if truncate and not head and len(payload) > 1:
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(payload)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self._send(status, payload, headers, head=head, content_type="application/octet-stream")
