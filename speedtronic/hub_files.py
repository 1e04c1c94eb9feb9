"""Files of Hugging Face Hub repos as local paths: the download side of the Hub ecosystem.

A Hub dataset is named ``hf://datasets/<owner>/<name>[@<revision>][/<path in the repo>]`` (the
spelling of huggingface_hub's file system). :func:`fetch` brings the files a caller asks for
into huggingface_hub's cache with its public ``snapshot_download`` and returns the local folder:

- only the files that match ``patterns`` are fetched (for ``prepare``: Parquet, JSONL, text);
- transient failures (connection errors, 5xx, 429 with its ``Retry-After``) are retried with the
  project's :class:`~speedtronic.retry.RetryPolicy`; 401/403/404 fail at once;
- an interrupted fetch resumes: huggingface_hub keeps partial files and finished files in its
  cache, so a second call downloads only what is missing;
- ``HF_HUB_OFFLINE=1`` answers from the cache alone, without a network call;
- the token (``token=None``: huggingface_hub's own ``HF_TOKEN`` / login) never appears in an
  error message.

Errors are :class:`HubFilesError` (a ``ValueError``: the CLI reports it as one line, exit 2).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.config.limits import is_hub_repo_id

if TYPE_CHECKING:
    from speedtronic.retry import RetryPolicy

__all__ = [
    "DATA_PATTERNS",
    "HubFilesError",
    "HubRef",
    "fetch",
    "parse_dataset",
    "resolve_inputs",
]

DATASET_PREFIX = "hf://datasets/"
#: The files ``prepare`` reads from a dataset repo (folders are walked like local ones).
DATA_PATTERNS = ("*.parquet", "*.jsonl", "*.ndjson", "*.txt")


class HubFilesError(ValueError):
    """A Hub reference that is malformed, missing, refused or unreachable (one line)."""


@dataclass(frozen=True)
class HubRef:
    """A repo on the Hub and a path inside it (``""``: the whole repo)."""

    repo_id: str
    repo_type: str
    revision: str | None = None
    path: str = ""


def parse_dataset(spec: str) -> HubRef | None:
    """``hf://datasets/owner/name[@rev][/path]`` as a :class:`HubRef`; ``None`` for any other
    input (a local path). A malformed ``hf://`` reference is a :class:`HubFilesError`."""
    if not spec.startswith("hf://"):
        return None
    if not spec.startswith(DATASET_PREFIX):
        raise HubFilesError(
            f"input {spec}: only Hub datasets are read, as hf://datasets/<owner>/<name>"
            "[@<revision>][/<path>]"
        )
    parts = spec[len(DATASET_PREFIX) :].strip("/").split("/")
    if len(parts) < 2:
        raise HubFilesError(f"input {spec}: expected hf://datasets/<owner>/<name>[/<path>]")
    name, _, revision = parts[1].partition("@")
    repo_id = f"{parts[0]}/{name}"
    if not is_hub_repo_id(repo_id) or (_ and not revision):
        raise HubFilesError(f"input {spec}: {repo_id!r} is not a Hub repo id (owner/name)")
    problem = _path_problem(parts[2:])
    if problem:
        raise HubFilesError(f"input {spec}: {problem}")
    return HubRef(repo_id, "dataset", revision or None, "/".join(parts[2:]))


def _path_problem(parts: Sequence[str]) -> str | None:
    """Why a path inside a repo (its ``/``-separated ``parts``) could lead out of the local
    snapshot (``folder / "/abs"`` is ``/abs``), or None."""
    if ".." in parts:
        return "'..' is not allowed in the path"
    if "" in parts or "." in parts or any("\\" in part or "\0" in part for part in parts):
        return "an empty ('//'), '.', backslash or NUL segment is not allowed in the path"
    return None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch(
    ref: HubRef,
    patterns: Sequence[str],
    *,
    token: str | None = None,
    cache_dir: str | Path | None = None,
    retry: RetryPolicy | None = None,
) -> Path:
    """The local snapshot folder of ``ref`` holding (at least) the files matching ``patterns``
    under ``ref.path`` (see the module for retries, resume and offline use). ``retry``: the
    policy (default: four quick tries, for a person at a prompt; a training run passes the
    one of its ``distributed`` section)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from speedtronic.retry import RetryPolicy, TransportError

    problem = _path_problem(ref.path.split("/")) if ref.path else None
    if problem:  # checked before any request: the path must stay inside the snapshot
        raise HubFilesError(f"{ref.repo_type} {ref.repo_id} path {ref.path!r}: {problem}")
    base = f"{ref.path.rstrip('/')}/" if ref.path else ""
    if ref.path and any(ref.path.endswith(p.lstrip("*")) for p in patterns):
        allow = [ref.path]  # one file
    else:
        allow = [f"{base}{pattern}" for pattern in patterns]
    # A person waits at a prompt: four tries within about 3.5 s, then the hint.
    secrets = (token,) if token else ()
    policy = retry or RetryPolicy(
        initial=0.5, maximum=4.0, attempts=4, timeout=30.0, secrets=secrets
    )
    where = f"{ref.repo_type} {ref.repo_id}" + (f"@{ref.revision}" if ref.revision else "")

    def download() -> str:
        try:
            return snapshot_download(
                ref.repo_id,
                repo_type=ref.repo_type,
                revision=ref.revision,
                allow_patterns=allow,
                token=token,
                cache_dir=cache_dir,
            )
        except LocalEntryNotFoundError as exc:
            # Online, the SDK reports "no network and nothing cached" as a missing entry; the
            # network failure under it is what the retry policy must see.
            if exc.__cause__ is not None and not _offline():
                raise exc.__cause__ from None
            raise

    try:
        folder = Path(policy.run(f"download of the Hub {where}", download))
    except TransportError as exc:
        if _offline():
            raise HubFilesError(
                f"{where} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids a "
                "download; fetch it once online, or unset HF_HUB_OFFLINE"
            ) from None
        hint = ""
        if exc.kind == "transient":
            hint = (
                "; without network, set HF_HUB_OFFLINE=1 to use files already in the Hugging "
                "Face cache"
            )
        raise HubFilesError(f"{exc}{hint}") from None
    target = folder / ref.path if ref.path else folder
    if not target.exists():
        raise HubFilesError(
            f"{where} holds no {ref.path or 'data files'} matching {', '.join(patterns)}"
        )
    return target


def resolve_inputs(inputs: Sequence[str], *, token: str | None = None) -> list[str]:
    """``inputs`` with every ``hf://datasets/...`` reference replaced by its local folder (or
    file) in the Hugging Face cache; local paths are returned unchanged."""
    resolved = []
    for item in inputs:
        ref = parse_dataset(item)
        resolved.append(item if ref is None else str(fetch(ref, DATA_PATTERNS, token=token)))
    return resolved
