"""Where ``model.init_from`` points, made a local folder: a folder as is, or a Hub repo.

``owner/name[@revision]`` is fetched by :func:`speedtronic.hub_files.fetch` (huggingface_hub's
public ``snapshot_download``, the same path ``prepare`` takes for Hub datasets) with
``allow_patterns`` limited to the config, the tokenizer files and the safetensors weights,
into the Hugging Face cache, under the run's retry policy (``distributed.retry_*``: backoff,
attempts, 429 ``Retry-After``) and with the token of the usual config layers (``HF_TOKEN``,
the ``hf_token`` secret, ``distributed.token``). ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and
``HF_HUB_OFFLINE=1`` (the cache only, no request) are the library's own settings, and so are
its transfers (its own per-request retries and timeouts, Xet where installed) inside each
attempt of the policy; a retried attempt keeps the files the failed one finished (they are in
the cache). A sharded checkpoint's shards are the ones its
``model.safetensors.index.json`` names, fetched in a second call. ``weights=False`` (a DiLoCo
worker, which takes the master's global 0) fetches the config and tokenizer only.

Errors (a ``ConfigError`` naming ``model.init_from``, exit 2): a repo or revision that does not
exist or that the token cannot see, an outage past the retries, a file missing from the cache
while offline, a folder without ``config.json`` or weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from speedtronic.config import ConfigError
from speedtronic.retry import RetryPolicy

__all__ = ["CONFIG", "INDEX", "SINGLE", "TOKENIZER_FILES", "fetch_checkpoint", "weight_files"]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_META = (CONFIG, "generation_config.json", *TOKENIZER_FILES)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w./-]+)?$")
_FIELD = "model.init_from"


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index names, else
    ``model.safetensors``; a ``ConfigError`` when there are none."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            named = list(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{_FIELD}: {index} is not a safetensors index ({exc})") from None
        for name in named:
            _inside(index, name)
        return [folder / name for name in sorted(set(named))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise ConfigError(
        f"{_FIELD}: {folder} has no {SINGLE} or {INDEX} (only safetensors weights are read; "
        "save the model with save_pretrained(..., safe_serialization=True))"
    )


def _inside(index: Path, name: object) -> None:
    """A weight file an index names must be a relative path inside the model folder: no
    absolute path, no ``..``, no empty or odd segment (a planted index cannot make a run read
    ``/etc/...`` or a file beside the checkpoint)."""
    text = name if isinstance(name, str) else ""  # "" for a non-string: refused below
    parts = text.split("/")  # an absolute path starts with an empty part
    if "\\" in text or "\0" in text or any(part in ("", ".", "..") for part in parts):
        raise ConfigError(
            f"{_FIELD}: {index} names the weight file {json.dumps(name)}, which is not a "
            "relative path inside the model folder"
        )


def fetch_checkpoint(
    spec: str, *, token: str | None, retry: RetryPolicy, weights: bool = True
) -> Path:
    """The local folder of ``spec`` (a folder, or a Hub repo fetched into the cache) holding
    ``config.json``, and with ``weights`` every weight file it needs."""
    local = Path(spec).expanduser()
    if local.is_dir():
        folder = local
    elif "/" not in spec.partition("@")[0] and not _looks_like_path(spec):
        raise ConfigError(  # a Hub id has an owner: a bare name is a folder that is not there
            f"{_FIELD}: no local folder {spec!r} (a Hub model is named owner/name[@revision])"
        )
    elif _looks_like_path(spec) or not _HUB_ID.match(spec):
        raise ConfigError(
            f"{_FIELD}: {spec} is neither a folder nor a Hub repo id (owner/name[@revision])"
        )
    else:
        folder = _from_hub(spec, token, retry, weights)
    if not (folder / CONFIG).is_file():
        raise ConfigError(f"{_FIELD}: {spec} has no {CONFIG} (is it a transformers model?)")
    if weights:
        missing = [path.name for path in weight_files(folder) if not path.is_file()]
        if missing:
            raise ConfigError(f"{_FIELD}: {spec} lacks the weight files {', '.join(missing)}")
    elif (folder / INDEX).is_file():
        weight_files(folder)  # its names are checked even when the weights are not read
    return folder


def _from_hub(spec: str, token: str | None, retry: RetryPolicy, weights: bool) -> Path:
    from speedtronic.hub_files import HubFilesError, HubRef, fetch

    repo_id, _, revision = spec.partition("@")
    ref = HubRef(repo_id, "model", revision or None)
    try:
        folder = fetch(ref, [*_META, SINGLE, INDEX] if weights else _META, token=token, retry=retry)
        if weights and (folder / INDEX).is_file():
            shards = [path.name for path in weight_files(folder) if not path.is_file()]
            if shards:
                folder = fetch(ref, shards, token=token, retry=retry)
    except HubFilesError as exc:
        raise ConfigError(f"{_FIELD}: {exc}") from None
    return folder
