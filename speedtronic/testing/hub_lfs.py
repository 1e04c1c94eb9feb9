"""The Hub's large-file (Git LFS) path, for the emulator in :mod:`.hub_server`.

What the real Hub does with a file that is not small, and what huggingface_hub 2.4.0 (Xet
off) does against it::

    POST /api/models/<repo>/preupload/<rev>        -> uploadMode "lfs" when the repo's
                                                      .gitattributes tracks the path with
                                                      filter=lfs (a new repo's tracks
                                                      *.safetensors, *.bin, ...) or when
                                                      size >= threshold
    POST /<repo>.git/info/lfs/objects/batch        -> per object: an upload action (a signed
                                                      storage URL; multipart: one URL per
                                                      part + a completion URL) and a verify
                                                      action, or no action when stored
    PUT  <storage>/lfs-objects/<oid>?sig=...       (basic) the bytes, no Hub token
    PUT  <storage>/lfs-objects/<oid>/<n>?sig=...   (multipart) part n, answers an ETag ...
    POST /_lfs/complete/<oid>?sig=...              ... then the completion with every ETag
    POST /<repo>.git/info/lfs/objects/verify       the object is stored with that size
    POST /api/models/<repo>/commit/<rev>           NDJSON ``lfsFile`` {path, algo, oid, size}
    HEAD/GET /<repo>/resolve/<rev>/<path>          302 to <storage>/lfs-objects/<oid>?sig=...
                                                   with X-Linked-Etag / X-Linked-Size
    GET  <storage>/lfs-objects/<oid>?sig=...       the bytes (Range, ETag), no Hub token

The storage is another origin (another host name for the loopback address, and its own
port), as S3 or the CDN is for the real Hub, so the client drops the ``Authorization``
header on the way there; storage refuses a request that carries one (S3 answers 400 to two
auth mechanisms) and counts it as ``storage:auth``.
Storage URLs are signed (an HMAC of the action and the object id) and refused unsigned.

:class:`LfsStorage` holds the objects and answers with ``(status, body, headers)`` tuples;
the request handler in :mod:`.hub_routes` sends them and applies the fault injection.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Any

from speedtronic.json_types import JSON

__all__ = [
    "HUB_GITATTRIBUTES",
    "LFS_THRESHOLD",
    "LfsConfig",
    "LfsStorage",
    "git_blob_oid",
    "lfs_pointer",
    "lfs_tracked",
]

#: The real Hub's limit for a regular (in-git) file: larger ones must go through LFS.
LFS_THRESHOLD = 10 * 1024 * 1024

#: The patterns the ``.gitattributes`` of a new Hub model repository tracks with LFS: the
#: preupload endpoint answers "lfs" for a path they match, whatever its size.
_HUB_LFS_PATTERNS = """*.7z *.arrow *.bin *.bz2 *.ckpt *.ftz *.gz *.h5 *.joblib *.lfs.* *.mlmodel
*.model *.msgpack *.npy *.npz *.onnx *.ot *.parquet *.pb *.pickle *.pkl *.pt *.pth *.rar
*.safetensors saved_model/**/* *.tar.* *.tar *.tflite *.tgz *.wasm *.xz *.zip *.zst *tfevents*"""
HUB_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in _HUB_LFS_PATTERNS.split()
)


def lfs_tracked(path: str, gitattributes: str) -> bool:
    """Whether ``gitattributes`` (a ``.gitattributes`` text) sets ``filter=lfs`` on ``path``:
    the last line whose pattern matches and that names a filter decides (a pattern without a
    slash matches the file name in any folder, as git reads it)."""
    tracked = False
    for line in gitattributes.splitlines():
        pattern, *attrs = line.split() or [""]
        if not pattern or pattern.startswith("#"):
            continue
        name = path if "/" in pattern else path.rsplit("/", 1)[-1]
        filters = [a for a in attrs if a.lstrip("-!").split("=")[0] == "filter"]
        if filters and fnmatch.fnmatchcase(name, pattern):
            tracked = filters[-1] == "filter=lfs"
    return tracked


Answer = tuple[int, Any, dict[str, str]]


@dataclasses.dataclass
class LfsConfig:
    """How the emulator answers the large-file path."""

    threshold: int = LFS_THRESHOLD  # bytes: a file at least this large is answered "lfs"
    part_size: int = 0  # bytes; > 0: larger objects are uploaded multipart, in parts this big
    verify: bool = True  # the batch answer carries a verify action
    advertise_xet: bool = False  # resolve answers carry X-Xet-Hash + refresh route (Xet repo)
    release_after: float = 30.0  # seconds an object no file points to any more is kept
    # the .gitattributes a new repository starts with ("": none; its paths go by size alone)
    gitattributes: str = HUB_GITATTRIBUTES


def lfs_pointer(oid: str, size: int) -> bytes:
    """The Git LFS pointer file that stands in git for an object of ``size`` bytes."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def git_blob_oid(data: bytes) -> str:
    """Git's blob id of ``data`` (sha1 of ``blob <len>\\0`` + data), as the Hub reports it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _error(status: int, message: str) -> Answer:
    return status, {"error": message}, {"X-Error-Message": message}


class LfsStorage:
    """Content-addressed object storage (sha256 ids) and the LFS batch / verify / multipart
    completion logic. Thread-safe; ``hub_url``/``storage_url`` are set once serving."""

    def __init__(self, config: LfsConfig | None = None) -> None:
        self.config = config or LfsConfig()
        self.hub_url = ""
        self.storage_url = ""
        self.objects: dict[str, bytes] = {}
        # released objects (no file points to them) -> (bytes, when): still readable and
        # committable for ``release_after`` seconds (a client may have been told "stored"
        # just before), never offered as stored to the batch endpoint, then dropped
        self._released: dict[str, tuple[bytes, float]] = {}
        self._parts: dict[str, dict[int, bytes]] = {}
        self._key = secrets.token_bytes(16)
        self._lock = threading.Lock()

    # -- decisions --------------------------------------------------------------------------
    def upload_mode(self, path: str, size: int, gitattributes: str) -> str:
        """``lfs`` for a path the repository's ``gitattributes`` tracks with LFS or a file of at
        least ``threshold`` bytes, else ``regular`` (what the Hub's preupload answers)."""
        big = size >= self.config.threshold
        return "lfs" if big or lfs_tracked(path, gitattributes) else "regular"

    def sign(self, action: str, oid: str) -> str:
        """The signature a storage URL for ``action`` on ``oid`` carries."""
        return hmac.new(self._key, f"{action}:{oid}".encode(), hashlib.sha256).hexdigest()[:32]

    def signed(self, action: str, oid: str, path: str, base: str | None = None) -> str:
        """A signed URL on the storage origin (or on ``base``)."""
        return f"{base or self.storage_url}{path}?sig={self.sign(action, oid)}"

    def download_url(self, oid: str) -> str:
        """Where the Hub redirects a download of ``oid``."""
        return self.signed("download", oid, f"/lfs-objects/{oid}")

    def redirect(self, repo_id: str, oid: str, size: int, sha: str) -> dict[str, str]:
        """The headers of the Hub's 302 from ``/resolve/`` for an LFS file (and the Xet ones a
        Xet-backed repository adds, when ``advertise_xet``)."""
        headers = {
            "Location": self.download_url(oid),
            "ETag": f'"{git_blob_oid(lfs_pointer(oid, size))}"',
            "X-Linked-Etag": f'"{oid}"',
            "X-Linked-Size": str(size),
            "X-Repo-Commit": sha,
        }
        if self.config.advertise_xet:
            route = f"{self.hub_url}/api/models/{repo_id}/xet-read-token/{sha}"
            headers["X-Xet-Hash"] = hashlib.sha256(b"xet:" + oid.encode()).hexdigest()
            headers["X-Xet-Refresh-Route"] = route
            headers["Link"] = f'<{route}>; rel="xet-auth"'
        return headers

    def stored(self, oid: str, size: int | None = None, live: bool = False) -> bytes | None:
        """The object ``oid`` (None when missing or of another size; with ``live``, also
        when it was released)."""
        with self._lock:
            data = self.objects.get(oid)
            if data is None and not live and oid in self._released:
                data = self._released[oid][0]
        if data is None or (size is not None and len(data) != size):
            return None
        return data

    def keep(self, oids: Iterable[str]) -> None:
        """Objects a commit points to again are live again."""
        with self._lock:
            for oid in oids:
                if oid in self._released:
                    self.objects[oid] = self._released.pop(oid)[0]

    def release(self, oids: Iterable[str]) -> None:
        """Objects no file points to any more: dropped after ``release_after`` seconds (the
        emulator keeps no history, and a long run must not hold every delta ever sent)."""
        now = time.monotonic()
        with self._lock:
            for oid in oids:
                if oid in self.objects:
                    self._released[oid] = (self.objects.pop(oid), now)
            expired = [
                o for o, (_, t) in self._released.items() if now - t >= self.config.release_after
            ]
            for oid in expired:
                del self._released[oid]

    # -- Hub endpoints ----------------------------------------------------------------------
    def batch(self, repo_id: str, request: JSON) -> Answer:
        """``POST /<repo>.git/info/lfs/objects/batch`` (upload only, as the SDK asks)."""
        if request.get("operation") != "upload":
            return _error(400, "the emulator's LFS batch endpoint only serves uploads")
        offered = request.get("transfers") or ["basic"]
        multipart = self.config.part_size > 0 and "multipart" in offered
        objects = []
        for item in request.get("objects", []):
            oid, size = str(item.get("oid", "")), item.get("size")
            if len(oid) != 64 or not isinstance(size, int) or size < 0:
                objects.append(
                    {
                        "oid": oid,
                        "size": size if isinstance(size, int) else 0,
                        "error": {"code": 422, "message": "invalid object"},
                    }
                )
                continue
            entry: JSON = {"oid": oid, "size": size, "authenticated": True}
            if self.stored(oid, size, live=True) is None:
                entry["actions"] = self._actions(repo_id, oid, size, multipart)
            objects.append(entry)
        transfer = "multipart" if multipart else "basic"
        return 200, {"transfer": transfer, "objects": objects, "hash_algo": "sha256"}, {}

    def _actions(self, repo_id: str, oid: str, size: int, multipart: bool) -> JSON:
        part = self.config.part_size
        if multipart and size > part:
            count = -(-size // part)
            header = {"chunk_size": str(part)}
            for n in range(1, count + 1):
                header[str(n)] = self.signed("part", f"{oid}/{n}", f"/lfs-objects/{oid}/{n}")
            href = self.signed("complete", oid, f"/_lfs/complete/{oid}", base=self.hub_url)
            upload: JSON = {"href": href, "header": header}
        else:
            upload = {"href": self.signed("upload", oid, f"/lfs-objects/{oid}")}
        actions = {"upload": upload}
        if self.config.verify:
            actions["verify"] = {"href": f"{self.hub_url}/{repo_id}.git/info/lfs/objects/verify"}
        return actions

    def verify(self, request: JSON) -> Answer:
        """``POST .../objects/verify``: 200 when the object is stored with that size."""
        if self.stored(str(request.get("oid")), request.get("size")) is None:
            return _error(404, "LFS object not found")
        return 200, {"success": True}, {}

    def complete(self, oid: str, sig: str, request: JSON) -> Answer:
        """Multipart completion: every part uploaded, ETags matching, content hashing to oid."""
        if not hmac.compare_digest(sig, self.sign("complete", oid)):
            return _error(403, "SignatureDoesNotMatch")
        with self._lock:
            parts = dict(self._parts.get(oid, {}))
        listed = request.get("parts") or []
        chunks = []
        for number, item in enumerate(listed, start=1):
            data = parts.get(number)
            if item.get("partNumber") != number or data is None:
                return _error(400, f"InvalidPart: part {number} was not uploaded")
            if item.get("etag") != _etag(data):
                return _error(400, f"InvalidPart: ETag of part {number} does not match")
            chunks.append(data)
        return self._store(oid, b"".join(chunks), drop_parts=True)

    # -- storage origin ---------------------------------------------------------------------
    def storage(self, method: str, rest: str, sig: str, body: bytes) -> Answer | bytes:
        """A storage request on ``/lfs-objects/<rest>``: an answer, or the object's bytes
        (GET/HEAD of a stored object; the handler serves them with Range and faults)."""
        oid, _, part = rest.partition("/")
        if method == "PUT" and part:
            if not part.isdigit() or not hmac.compare_digest(
                sig, self.sign("part", f"{oid}/{part}")
            ):
                return _error(403, "SignatureDoesNotMatch")
            with self._lock:
                self._parts.setdefault(oid, {})[int(part)] = body
            return 200, b"", {"ETag": _etag(body)}
        if method == "PUT":
            if not hmac.compare_digest(sig, self.sign("upload", oid)):
                return _error(403, "SignatureDoesNotMatch")
            return self._store(oid, body)
        if method in ("GET", "HEAD") and not part:
            if not hmac.compare_digest(sig, self.sign("download", oid)):
                return _error(403, "SignatureDoesNotMatch")
            data = self.stored(oid)
            return data if data is not None else _error(404, "NoSuchKey")
        return _error(405, f"{method} not supported on storage")

    def _store(self, oid: str, data: bytes, drop_parts: bool = False) -> Answer:
        if hashlib.sha256(data).hexdigest() != oid:
            return _error(400, "BadDigest: the content does not hash to the object id")
        with self._lock:
            self.objects[oid] = data
            self._released.pop(oid, None)
            if drop_parts:
                self._parts.pop(oid, None)
        return 200, b"", {"ETag": _etag(data)}


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest()}"'


def json_body(body: bytes) -> JSON:
    """A JSON object from a request body ({} when empty or not an object)."""
    try:
        value = json.loads(body or b"{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
