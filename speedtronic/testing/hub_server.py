"""A small Hugging Face Hub emulator for tests and local demos (loopback only, stdlib only).

It speaks the endpoints that huggingface_hub 2.4.0 uses for DumbDiLoCo::

    POST /api/repos/create                               create_repo (409 when it exists)
    GET  /api/whoami-v2                                  whoami
    GET  /api/models/<owner>/<name>/revision/<rev>       repo_info
    GET  /api/models/<owner>/<name>/tree/<rev>[/<path>]  list_repo_tree / list_repo_files
    POST /api/models/<owner>/<name>/preupload/<rev>      uploadMode "lfs" for a path the repo's
                                                         .gitattributes tracks with LFS (a new
                                                         repo's, as on the Hub: *.safetensors,
                                                         *.bin, ...; ``lfs.gitattributes``) or
                                                         from ``lfs.threshold`` bytes on (10
                                                         MiB, as the Hub), else "regular"
    POST /api/models/<owner>/<name>/commit/<rev>         NDJSON: header, file (base64), lfsFile
                                                         (pointer to a stored object),
                                                         deletedFile, deletedFolder
    HEAD/GET /<owner>/<name>/resolve/<rev>/<path>        hf_hub_download (ETag, X-Repo-Commit,
                                                         Content-Length, Range resume); an LFS
                                                         file is a 302 to the storage origin
    POST /<owner>/<name>.git/info/lfs/objects/batch|verify, POST /_lfs/complete/<oid>, and
    PUT/GET/HEAD <storage>/lfs-objects/<oid>[/<part>]    the large-file path (:mod:`.hub_lfs`)

Requests to ``/api/models/<repo>/xet-*`` (the Xet token routes) are counted as ``xet`` and
answered 404: the emulator has no Xet storage, and a test can see whether a client tried it.

Access (``token``/``tokens``, ``read_only_tokens``, ``refused_tokens``): a token on no list
sees no repository (404 "Repository not found", as the Hub answers a token without access),
a read-only token gets 403 on create and commit, a refused token 401 everywhere.

Fault injection (seeded, so runs are reproducible): a fraction of requests answered 503
(``error_rate``), 429 with ``Retry-After`` (``rate_limit_rate``/``retry_after``), connections
closed without an answer (``drop_rate``), delayed (``slow_rate``/``slow_seconds``), and
downloads cut short (``truncate_rate``). Faults hit requests before they change anything, on
the storage origin too. ``endpoints`` limits them to endpoint kinds (``commit``, ``resolve``,
``lfs-batch``, ``storage-upload``, ``storage-download``, ...; ``lfs`` and ``storage`` name
every kind with that prefix).
``GET /_emulator/stats`` reports counters; ``POST /_emulator/faults`` changes the knobs.

Run it as ``python -m speedtronic.testing.hub_server --port 8765`` and point the SDK at it
with ``HF_ENDPOINT=http://127.0.0.1:8765``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable
from http.server import ThreadingHTTPServer
from typing import Any

from speedtronic.json_types import JSON
from speedtronic.testing.hub_budget import Budget, BudgetKeeper
from speedtronic.testing.hub_lfs import LfsConfig, LfsStorage
from speedtronic.testing.hub_routes import HubHandler, Repo, endpoint_kind

__all__ = ["FaultConfig", "HubEmulator", "LfsConfig", "main", "token_tag"]


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


def token_tag(token: str) -> str:
    """How stats name a token: a short digest, never the token itself ('' for none)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12] if token else ""


class HubHTTPServer(ThreadingHTTPServer):
    """One origin of ``hub`` (the Hub's API, or its LFS storage when ``storage``), served by
    `HubHandler` threads. A client that hangs up mid-response (a killed node, a client
    timeout) is normal here: counted as ``client_gone``, not printed as a traceback."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], hub: HubEmulator, *, storage: bool) -> None:
        super().__init__(address, HubHandler)
        self.hub = hub
        self.storage = storage

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Count a vanished client; report anything else the usual way."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            hub = self.hub
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
        lfs: LfsConfig | None = None,
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
        self.repos: dict[str, Repo] = {}
        self.commits = 0
        self._rng = random.Random(self.faults.seed)
        self._counts: collections.Counter[str] = collections.Counter()
        self._fault_kinds: collections.Counter[str] = collections.Counter()  # "drop resolve"
        self._by_token: dict[str, dict[str, int]] = {}  # token_tag -> requests, commits
        # called as on_commit(repo_id, {path: bytes}) after each commit lands, under the lock
        self.on_commit: Callable[[str, dict[str, bytes]], None] | None = None
        # the large-file path: its object storage answers on a second port, under another
        # host name for the same loopback address (another origin, as S3 for the Hub)
        self.lfs = LfsStorage(lfs)
        self._servers: list[HubHTTPServer] = []
        self._storage_port = 0

    @property
    def url(self) -> str:
        """Base URL (``HF_ENDPOINT``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def storage_url(self) -> str:
        """Base URL of the LFS object storage: another host name for the same loopback
        address (``localhost`` for ``127.0.0.1`` and back) and its own port, as S3 or the CDN
        is another host for the Hub (clients compare host names, or whole origins, to decide
        whether the Hub token may follow a redirect)."""
        other = "127.0.0.1" if self.host == "localhost" else "localhost"
        return f"http://{other}:{self._storage_port}"

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
            if wanted and not {endpoint, endpoint.split("-")[0]} & wanted:
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
                    self._fault_kinds[f"{name} {endpoint}"] += 1
                    return name
        return None

    def count(self, method: str, path: str) -> None:
        """Count a served request by method and endpoint kind."""
        kind = endpoint_kind(path, method)
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

    def stats(self) -> JSON:
        """Counters: requests, injected faults, refusals past a budget, commits, repos."""
        with self.lock:
            return {
                "counts": dict(self._counts),
                "faults_by_endpoint": dict(self._fault_kinds),
                "budget_refused": dict(self.budget.refused),
                "commits": self.commits,
                "commits_by_repo": {k: v.commits for k, v in self.repos.items()},
                "by_token": {k: dict(v) for k, v in self._by_token.items()},
                "repos": {k: sorted(v.files) for k, v in self.repos.items()},
                "lfs_files": {k: sorted(v.lfs) for k, v in self.repos.items()},
                "lfs_objects": len(self.lfs.objects),
            }

    def files(self, repo_id: str) -> dict[str, bytes]:
        """A copy of the files of ``repo_id``."""
        with self.lock:
            return dict(self.repos[repo_id].files)

    def start(self) -> HubEmulator:
        """Bind and serve (the Hub, and its LFS storage on a second port) in daemon threads;
        returns self (``port`` is filled in)."""
        for storage in (False, True):
            server = HubHTTPServer((self.host, 0 if storage else self.port), self, storage=storage)
            name = "hub-emulator-storage" if storage else "hub-emulator"
            threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
            self._servers.append(server)
        self.port = self._servers[0].server_address[1]
        self._storage_port = self._servers[1].server_address[1]
        self.lfs.hub_url, self.lfs.storage_url = self.url, self.storage_url
        return self

    def stop(self) -> None:
        """Stop serving and close the sockets."""
        while self._servers:
            server = self._servers.pop()
            server.shutdown()
            server.server_close()

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
    for knobs, prefix in ((FaultConfig, ""), (Budget, ""), (LfsConfig, "lfs_")):
        for field in dataclasses.fields(knobs):
            kind = type(field.default)
            parser.add_argument(
                f"--{(prefix + field.name).replace('_', '-')}",
                dest=prefix + field.name,
                type=(lambda v: v.lower() in ("1", "true", "yes")) if kind is bool else kind,
                default=field.default,
            )
    args = parser.parse_args(argv)

    def knobs_of(cls: Any, prefix: str = "") -> Any:
        return cls(**{f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(cls)})

    emulator = HubEmulator(
        args.port,
        token=args.token,
        faults=knobs_of(FaultConfig),
        host=args.host,
        budget=knobs_of(Budget),
        lfs=knobs_of(LfsConfig, "lfs_"),
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
