"""Where ``model.init_from`` points, made a local folder: a folder as is, or a Hub repo.

``owner/name[@revision]`` is fetched with huggingface_hub's public ``snapshot_download``
(``allow_patterns``: the config, the tokenizer files and the safetensors weights, nothing
else) into its cache, under the project's retry policy (:class:`RetryPolicy`, from the
``distributed`` section: backoff, attempts, 429 ``Retry-After``) and with the token of the usual
config layers (``HF_TOKEN``, the ``hf_token`` secret, ``distributed.token``). ``HF_ENDPOINT``,
``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` (the cache only, no request) are the library's own
settings. As for the DiLoCo Hub store, the SDK's own retries and Xet are switched off
(:func:`speedtronic.diloco.hub.install_sdk_client`): one retry layer, each attempt bounded by
``distributed.request_timeout``, large files over the LFS path; a retried attempt keeps the
files the failed one finished (they are in the cache). A sharded checkpoint's shards are the
ones its ``model.safetensors.index.json`` names, fetched in a second call. ``weights=False``
(a DiLoCo worker, which takes the master's global 0) fetches the config and tokenizer only.

Errors: a repo or revision that does not exist or that the token cannot see, a folder without
``config.json`` or weights, a file missing from the cache while offline: a ``ConfigError``
naming ``model.init_from``. An outage that outlasts the retries: ``HubUnavailable``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

from speedtronic.config import ConfigError
from speedtronic.diloco.exchange import RetryPolicy, TransportError

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
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{_FIELD}: {index} is not a safetensors index ({exc})") from None
        return [folder / name for name in names]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise ConfigError(
        f"{_FIELD}: {folder} has no {SINGLE} or {INDEX} (only safetensors weights are read; "
        "save the model with save_pretrained(..., safe_serialization=True))"
    )


def fetch_checkpoint(
    spec: str, *, token: str | None, retry: RetryPolicy, weights: bool = True
) -> Path:
    """The local folder of ``spec`` (a folder, or a Hub repo fetched into the cache) holding
    ``config.json``, and with ``weights`` every weight file it needs."""
    local = Path(spec).expanduser()
    if local.is_dir():
        folder = local
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
    return folder


def _from_hub(spec: str, token: str | None, retry: RetryPolicy, weights: bool) -> Path:
    from huggingface_hub import constants

    repo_id, _, revision = spec.partition("@")
    offline = bool(constants.HF_HUB_OFFLINE)
    if offline:  # the cache answers at once; retrying a miss cannot help
        retry = dataclasses.replace(retry, attempts=1)
    patterns = [*_META, SINGLE, INDEX] if weights else list(_META)
    folder = Path(_snapshot(repo_id, revision or None, patterns, token, retry, offline))
    if weights and (folder / INDEX).is_file():
        shards = [path.name for path in weight_files(folder) if not path.is_file()]
        if shards:
            folder = Path(_snapshot(repo_id, revision or None, shards, token, retry, offline))
    return folder


def _snapshot(
    repo_id: str,
    revision: str | None,
    patterns: list[str],
    token: str | None,
    retry: RetryPolicy,
    offline: bool,
) -> str:
    """One ``snapshot_download`` under the retry policy; its errors as ours."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from speedtronic.diloco.hub import hub_call, install_sdk_client

    install_sdk_client()  # our policy is the one retry layer; LFS, not Xet (diloco/hub.py)

    def call() -> str:
        try:
            with hub_call(retry.timeout):
                return snapshot_download(
                    repo_id, revision=revision, allow_patterns=patterns, token=token or None
                )
        except LocalEntryNotFoundError as exc:
            # Online, the SDK answers "not in the cache" for any failed listing (a 503 too):
            # let the Hub's own answer decide whether to retry.
            cause = exc.__cause__
            if not offline and isinstance(cause, Exception):
                raise cause from None
            raise

    where = f"{repo_id}@{revision}" if revision else repo_id
    return _run(retry, f"download {where}", call, where, offline)


def _run(
    retry: RetryPolicy, operation: str, call: Callable[[], str], where: str, offline: bool
) -> str:
    try:
        return retry.run(operation, call)
    except TransportError as exc:
        if exc.kind == "transient":
            raise  # an outage past the retries: a runtime failure, not a configuration one
        if offline:
            raise ConfigError(
                f"{_FIELD}: {where} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 "
                "forbids downloading it (run once online, or unset HF_HUB_OFFLINE)"
            ) from None
        reason = "not found on the Hub, or the token cannot see it"
        if exc.status in (401, 403):
            reason = f"refused by the Hub (HTTP {exc.status}): check the token"
        raise ConfigError(f"{_FIELD}: {where}: {reason} ({exc})") from None
