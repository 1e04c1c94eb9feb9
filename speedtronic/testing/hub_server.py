"""A small Hugging Face Hub emulator for tests and local demos (loopback only, stdlib only).

It speaks the endpoints that huggingface_hub 2.4.0 uses for DumbDiLoCo::

    POST /api/repos/create                               create_repo (409 when it exists)
    GET  /api/whoami-v2                                  whoami
    GET  /api/models/<owner>/<name>/revision/<rev>       repo_info
    GET  /api/models/<owner>/<name>/tree/<rev>[/<path>]  list_repo_tree / list_repo_files
    POST /api/models/<owner>/<name>/preupload/<rev>      always answers uploadMode "regular"
    POST /api/models/<owner>/<name>/commit/<rev>         NDJSON: header, file (base64), deletedFile
    HEAD/GET /<owner>/<name>/resolve/<rev>/<path>        hf_hub_download (ETag, X-Repo-Commit,
                                                         Content-Length, Range resume)

Access (``token``/``tokens``, ``read_only_tokens``, ``refused_tokens``): a token on no list
sees no repository (404 "Repository not found", as the Hub answers a token without access),
a read-only token gets 403 on create and commit, a refused token 401 everywhere.

Fault injection (seeded, so runs are reproducible): a fraction of requests answered 503
(``error_rate``), 429 with ``Retry-After`` (``rate_limit_rate``/``retry_after``), connections
closed without an answer (``drop_rate``), delayed (``slow_rate``/``slow_seconds``), and
downloads cut short (``truncate_rate``). Faults hit requests before they change anything.
``GET /_emulator/stats`` reports counters; ``POST /_emulator/faults`` changes the knobs.

Run it as ``python -m speedtronic.testing.hub_server --port 8765`` and point the SDK at it
with ``HF_ENDPOINT=http://127.0.0.1:8765``.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import dataclasses
import hashlib
import json
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from speedtronic.testing.hub_budget import Budget, BudgetKeeper

__all__ = ["FaultConfig", "HubEmulator", "main", "token_tag"]

_API = re.compile(r"^/api/models/([^/]+/[^/]+)/(revision|tree|preupload|commit)/([^/]+)(/.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclasses.dataclass
class FaultConfig:
    """Fractions (0..1) of requests that fail in each way, and their parameters."""

    error_rate: float = 0.0
    rate_limit_rate: float = 0.0
    retry_after: float = 1.0
    drop_rate: float = 0.0
    slow_rate: float = 0.0
    slow_seconds: float = 0.5
    truncate_rate: float = 0.0
    latency: float = 0.0  # seconds added to every request (a network far away) ...
    latency_jitter: float = 0.0  # ... plus up to this much more, uniformly
    seed: int = 0
    endpoints: str = ""  # comma list (create, tree, preupload, commit, resolve, ...); "" = all


@dataclasses.dataclass
class _Repo:
    private: bool
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    sha: str = "0" * 40
    commits: int = 0


def _endpoint(path: str) -> str:
    """Endpoint kind of a request path: create, whoami, tree, commit, resolve, ..."""
    path = unquote(path)
    match = _API.match(path)
    if match:
        return match.group(2)
    if _RESOLVE.match(path):
        return "resolve"
    if path == "/api/repos/create":
        return "create"
    if path.startswith("/api/whoami"):
        return "whoami"
    return path.strip("/").replace("/", "_") or "root"


class _Handler(BaseHTTPRequestHandler):
    server_version = "SpeedtronicHubEmulator/1.0"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    @property
    def hub(self) -> HubEmulator:
        return self.server.hub  # type: ignore[attr-defined]

    # -- plumbing ---------------------------------------------------------------------------
    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

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

    def _fault(self, download: bool) -> str | None:
        """Decide (under the lock) whether this request fails, and how."""
        if self.path.startswith("/_emulator"):
            return None
        fault = self.hub.draw_fault(download, _endpoint(urlparse(self.path).path))
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

    def _authorised(self, repo: _Repo | None) -> bool:
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

    def _dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        body = self._body() if method == "POST" else b""
        resolve = _RESOLVE.match(path)
        fault = self._fault(download=bool(resolve) and method == "GET")
        if fault in ("dropped", "error", "rate_limit"):
            return
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
        if path == "/api/whoami-v2":
            if not self._authorised(None):
                return self._error(401, "Invalid credentials in Authorization header")
            return self._json(200, {"type": "user", "name": "emulator", "auth": {}})
        info = re.match(r"^/api/models/([^/]+/[^/]+)$", path)
        if info and method == "GET":
            return self._api(method, info.group(1), "revision", "", query, body)
        match = _API.match(path)
        if match:
            repo_id, action, _rev, rest = match.groups()
            return self._api(method, repo_id, action, (rest or "").lstrip("/"), query, body)
        if resolve:
            repo_id, _rev, file_path = resolve.groups()
            return self._resolve(method, repo_id, file_path, truncate=fault == "truncate")
        self._error(404, f"no route for {method} {path}", head=method == "HEAD")

    def _repo_or_404(self, repo_id: str, head: bool = False) -> _Repo | None:
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
            self.hub.repos[repo_id] = _Repo(private=private)
        self._json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def _api(
        self, method: str, repo_id: str, action: str, rest: str, query: dict, body: bytes
    ) -> None:
        repo = self._repo_or_404(repo_id)
        if repo is None:
            return
        if action == "revision" and method == "GET":
            with self.hub.lock:
                return self._json(
                    200,
                    {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": repo.sha,
                        "private": repo.private,
                        "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                    },
                )
        if action == "tree" and method == "GET":
            return self._tree(repo, rest, query)
        if action == "preupload" and method == "POST":
            files = json.loads(body or b"{}").get("files", [])
            return self._json(
                200,
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in files
                    ]
                },
            )
        if action == "commit" and method == "POST":
            return self._commit(repo_id, repo, body)
        self._error(405, f"{method} not supported on {action}")

    def _tree(self, repo: _Repo, prefix: str, query: dict) -> None:
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = prefix.strip("/")
        base = f"{prefix}/" if prefix else ""
        with self.hub.lock:
            files = {p: d for p, d in repo.files.items() if p.startswith(base)}
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
                entries.append(
                    {
                        "type": "file",
                        "path": path,
                        "size": len(data),
                        "oid": hashlib.sha1(data).hexdigest(),
                    }
                )
        entries += [
            {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
            for d in sorted(dirs)
        ]
        self._json(200, entries)

    def _commit(self, repo_id: str, repo: _Repo, body: bytes) -> None:
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
        deletes: list[str] = []
        for item in lines:
            key, value = item.get("key"), item.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    return self._error(400, "only base64 file entries are supported")
                adds[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                deletes.append(value["path"])
            elif key == "deletedFolder":
                deletes.append(value["path"].rstrip("/") + "/")
            elif key == "lfsFile":
                return self._error(
                    400, "LFS is not supported by the emulator (preupload says regular)"
                )
        with self.hub.lock:
            for path in deletes:
                if path.endswith("/"):
                    continue
                if path not in repo.files and path not in adds:
                    return self._error(404, "A file with this name doesn't exist", "EntryNotFound")
            for path, data in adds.items():
                repo.files[path] = data
            for path in deletes:
                if path.endswith("/"):
                    for p in [p for p in repo.files if p.startswith(path)]:
                        del repo.files[p]
                elif path not in adds:
                    repo.files.pop(path, None)
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
            sha = repo.sha
        if data is None:
            return self._error(
                404, "Entry not found", "EntryNotFound", extra={"X-Repo-Commit": sha}, head=head
            )
        headers = {
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "X-Repo-Commit": sha,
            "Accept-Ranges": "bytes",
        }
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


def token_tag(token: str) -> str:
    """How stats name a token: a short digest, never the token itself ('' for none)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12] if token else ""


class _Server(ThreadingHTTPServer):
    """A client that hangs up mid-response (a killed node, a client timeout) is normal here:
    counted as ``client_gone``, not printed as a traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Count a vanished client; report anything else the usual way."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            hub = self.hub  # type: ignore[attr-defined]
            with hub.lock:
                hub._counts["client_gone"] += 1
            return
        super().handle_error(request, client_address)


class HubEmulator:
    """The emulator: ``start()`` serves on 127.0.0.1 in a daemon thread, ``stop()`` ends it."""

    def __init__(
        self,
        port: int = 0,
        *,
        token: str | None = None,
        faults: FaultConfig | None = None,
        host: str = "127.0.0.1",
        tokens: Iterable[str] = (),
        budget: Budget | None = None,
        read_only_tokens: Iterable[str] = (),
        refused_tokens: Iterable[str] = (),
    ):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the Hub emulator binds to loopback only")
        self.host, self.port, self.token = host, port, token
        self.tokens = {t for t in (token, *tokens) if t}  # any of them is accepted
        # Access as the Hub answers it: any other token sees no repository (404 "Repository
        # not found"; 401 on whoami and create), a read-only token gets 403 on create and
        # commit, a refused (invalid) token gets 401 "Invalid credentials" on every endpoint.
        self.read_only_tokens = {t for t in read_only_tokens if t}
        self.refused_tokens = {t for t in refused_tokens if t}
        self.budget = BudgetKeeper(budget or Budget())
        self.faults = faults or FaultConfig()
        self.lock = threading.RLock()
        self.repos: dict[str, _Repo] = {}
        self.commits = 0
        self._rng = random.Random(self.faults.seed)
        self._counts: collections.Counter[str] = collections.Counter()
        self._by_token: dict[str, dict[str, int]] = {}  # token_tag -> requests, commits
        # called as on_commit(repo_id, {path: bytes}) after each commit lands, under the lock
        self.on_commit: Callable[[str, dict[str, bytes]], None] | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL (``HF_ENDPOINT``)."""
        return f"http://{self.host}:{self.port}"

    def set_faults(self, **knobs: Any) -> None:
        """Change fault knobs at runtime (re-seeds when ``seed`` is given)."""
        with self.lock:
            for key, value in knobs.items():
                if not hasattr(self.faults, key):
                    raise ValueError(f"unknown fault knob {key}")
                setattr(self.faults, key, type(getattr(self.faults, key))(value))
            if "seed" in knobs:
                self._rng = random.Random(self.faults.seed)

    def draw_fault(self, download: bool, endpoint: str = "") -> str | None:
        """One seeded draw per request (only for the configured endpoints)."""
        f = self.faults
        with self.lock:
            wanted = {e.strip() for e in f.endpoints.split(",") if e.strip()}
            if wanted and endpoint not in wanted:
                return None
            roll = self._rng.random()
            order = [
                ("drop", f.drop_rate),
                ("error", f.error_rate),
                ("rate_limit", f.rate_limit_rate),
                ("slow", f.slow_rate),
            ]
            if download:
                order.append(("truncate", f.truncate_rate))
            edge = 0.0
            for name, rate in order:
                edge += max(0.0, rate)
                if roll < edge:
                    self._counts[f"fault:{name}"] += 1
                    return name
        return None

    def count(self, method: str, path: str) -> None:
        """Count a served request by method and endpoint kind."""
        kind = _endpoint(path)
        with self.lock:
            self._counts[f"{method} {kind}"] += 1

    def tally(self, token: str, what: str) -> None:
        """Count a served request or a landed commit against the caller's token (by tag)."""
        with self.lock:
            row = self._by_token.setdefault(token_tag(token), {"requests": 0, "commits": 0})
            row[what] += 1

    def delay(self) -> None:
        """Sleep the configured latency (plus jitter) before serving a request."""
        f = self.faults
        if f.latency or f.latency_jitter:
            with self.lock:
                jitter = self._rng.random() * f.latency_jitter
            time.sleep(f.latency + jitter)

    def stats(self) -> dict[str, Any]:
        """Counters: requests, injected faults, refusals past a budget, commits, repos."""
        with self.lock:
            return {
                "counts": dict(self._counts),
                "budget_refused": dict(self.budget.refused),
                "commits": self.commits,
                "commits_by_repo": {k: v.commits for k, v in self.repos.items()},
                "by_token": {k: dict(v) for k, v in self._by_token.items()},
                "repos": {k: sorted(v.files) for k, v in self.repos.items()},
            }

    def files(self, repo_id: str) -> dict[str, bytes]:
        """A copy of the files of ``repo_id``."""
        with self.lock:
            return dict(self.repos[repo_id].files)

    def start(self) -> HubEmulator:
        """Bind and serve in a daemon thread; returns self (``port`` is filled in)."""
        self._server = _Server((self.host, self.port), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="hub-emulator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m speedtronic.testing.hub_server --port N [fault flags]``."""
    parser = argparse.ArgumentParser(description="Speedtronic Hugging Face Hub emulator")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--token", default=None, help="require this bearer token")
    for knobs in (FaultConfig, Budget):
        for field in dataclasses.fields(knobs):
            parser.add_argument(
                f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default
            )
    args = parser.parse_args(argv)
    faults = FaultConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FaultConfig)})
    budget = Budget(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Budget)})
    emulator = HubEmulator(
        args.port, token=args.token, faults=faults, host=args.host, budget=budget
    ).start()
    print(f"hub emulator listening on {emulator.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        emulator.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
