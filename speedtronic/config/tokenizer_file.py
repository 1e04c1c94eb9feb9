"""What ``data.tokenizer`` names, read without importing ``tokenizers`` or torch.

``bytes`` (one token per UTF-8 byte), or a Hugging Face ``tokenizer.json``: a path to the file
or to a folder holding it, or a Hub repo id ``owner/name[@revision]`` fetched once into the
``huggingface_hub`` cache. Before a download one TCP connection to the Hub (or its proxy) is
tried for `HUB_PROBE_SECONDS`, so an unreachable Hub gives the cached file or, in seconds, a
``ConfigError`` saying how to work offline. Validation reads the ids here (they must fit
``model.vocab_size``); :mod:`speedtronic.data.tokenizer` builds the tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import socket
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from speedtronic.config.limits import ConfigError

__all__ = [
    "BYTES",
    "EOS_NAMES",
    "TokenizerInfo",
    "describe_tokenizer",
    "hub_unreachable",
    "is_bytes",
    "resolve_tokenizer_file",
]

_LOG = logging.getLogger("speedtronic.data")
BYTES = "bytes"
#: Seconds the Hub endpoint (or its proxy) gets to accept a TCP connection before a download.
HUB_PROBE_SECONDS = 3.0
# Special tokens recognised as end-of-text, most common first.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|eot|>")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w./-]+)?$")


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer file as validation sees it.

    ``vocab_size`` counts ids (highest id + 1, added tokens included); ``eos_id`` /
    ``eos_token`` are ``None`` when the file has no end-of-text token; ``config_path`` is the
    ``tokenizer_config.json`` found beside it, if any. ``sha256`` hashes the file's bytes,
    ``encoding`` what it encodes (:func:`_encoding_digest`): an exported copy of the file,
    whose post-processor and decoder differ, encodes the same ids and has the same one.
    """

    spec: str
    path: Path
    sha256: str
    vocab_size: int
    eos_id: int | None
    eos_token: str | None
    config_path: Path | None = None
    encoding: str = ""


def is_bytes(spec: object) -> bool:
    """True when ``spec`` selects the byte-level tokenizer (``bytes``, any case, or empty)."""
    return spec is None or str(spec).strip().lower() in ("", BYTES)


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", ".", "~"))
        or spec.endswith(".json")
        or spec.count("/") > 1
        or os.sep in spec.replace("/", "")
    )


def resolve_tokenizer_file(
    spec: str, *, field: str = "data.tokenizer", token: str | None = None
) -> tuple[Path, Path | None]:
    """``(tokenizer.json path, tokenizer_config.json path or None)`` for a path or Hub id."""
    text = str(spec).strip()
    local = Path(text).expanduser()
    if local.is_dir():
        candidate = local / "tokenizer.json"
        if not candidate.is_file():
            raise ConfigError(f"{field}: {text} is a folder without a tokenizer.json")
        return candidate, _beside(candidate)
    if local.is_file():
        return local, _beside(local)
    if _looks_like_path(text) or not _HUB_ID.match(text):
        raise ConfigError(
            f"{field}: tokenizer file not found: {text} (give a tokenizer.json path, a Hub "
            "repo id such as owner/name, or bytes)"
        )
    return _from_hub(text, field, token)


def _beside(path: Path) -> Path | None:
    config = path.with_name("tokenizer_config.json")
    return config if config.is_file() else None


@functools.lru_cache(maxsize=8)
def _from_hub(spec: str, field: str, token: str | None) -> tuple[Path, Path | None]:
    """Download (or find in the cache) a Hub repo's tokenizer files, once per process."""
    repo_id, _, revision = spec.partition("@")
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    offline = constants.HF_HUB_OFFLINE
    why = None if offline else hub_unreachable(constants.ENDPOINT)
    if why is not None:
        cached = try_to_load_from_cache(repo_id, "tokenizer.json", revision=revision or None)
        if not isinstance(cached, str):
            raise ConfigError(
                f"{field}: cannot reach the Hub ({constants.ENDPOINT}: {why}) to fetch "
                f"tokenizer.json of {repo_id}, and it is not in the local cache "
                f"({constants.HF_HUB_CACHE}); without network, put the file in the cache "
                "and set HF_HUB_OFFLINE=1, or give a local tokenizer.json path"
            )
        _LOG.warning(
            "the Hub is unreachable (%s: %s); using the cached tokenizer.json of %s "
            "(set HF_HUB_OFFLINE=1 to skip this check)",
            constants.ENDPOINT,
            why,
            repo_id,
        )
        offline = True

    def fetch(name: str) -> str:
        return hf_hub_download(
            repo_id, name, revision=revision or None, token=token, local_files_only=offline
        )

    try:
        path = fetch("tokenizer.json")
    except Exception as exc:
        detail = " ".join(str(exc).split())[:200]
        hint = (
            "; with HF_HUB_OFFLINE=1 the file must be in the local cache"
            if offline
            else "; without network, put the file in the cache and set HF_HUB_OFFLINE=1"
        )
        raise ConfigError(
            f"{field}: cannot fetch tokenizer.json from the Hub repo {repo_id}: "
            f"{type(exc).__name__}: {detail}{hint}"
        ) from None
    try:
        config = fetch("tokenizer_config.json")
    except Exception:
        config = None  # optional: the end-of-text token is then looked up by name
    return Path(path), Path(config) if config else None


def hub_unreachable(endpoint: str, seconds: float = HUB_PROBE_SECONDS) -> str | None:
    """Why the Hub at ``endpoint`` cannot be reached, or None when a TCP connection to it (to
    its proxy when one is configured for it) opens within ``seconds``, name lookup included.
    """
    url = urllib.parse.urlsplit(endpoint)
    host = url.hostname
    if not host:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = via.hostname or host, via.port or 80
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=seconds):
                outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or type(exc).__name__)

    thread = threading.Thread(target=probe, name="speedtronic-hub-probe", daemon=True)
    thread.start()
    thread.join(seconds)  # a name lookup that hangs is not waited for longer
    return outcome[0] if outcome else f"no answer within {seconds:g} s"


def describe_tokenizer(
    spec: str, *, field: str = "data.tokenizer", token: str | None = None
) -> TokenizerInfo:
    """Resolve ``spec`` (not ``bytes``) and read its vocabulary and end-of-text token."""
    path, config_path = resolve_tokenizer_file(spec, field=field, token=token)
    stat = path.stat()
    sha256, parts, tokens, special = _read(str(path), stat.st_size, stat.st_mtime_ns, field)
    eos_token = _configured_eos(config_path) if config_path else None
    if eos_token is not None and eos_token not in tokens:
        raise ConfigError(
            f"{field}: {config_path} names eos_token {eos_token!r}, which {path} does not hold"
        )
    if eos_token is None:
        eos_token = next((name for name in EOS_NAMES if name in special), None)
    eos_id = tokens[eos_token] if eos_token is not None else None
    vocab_size = max(tokens.values()) + 1
    encoding = hashlib.sha256(f"{parts}\0{eos_id}".encode()).hexdigest()
    return TokenizerInfo(
        str(spec).strip(), path, sha256, vocab_size, eos_id, eos_token, config_path, encoding
    )


@functools.lru_cache(maxsize=16)
def _read(
    path: str, size: int, mtime_ns: int, field: str
) -> tuple[str, str, dict[str, int], set[str]]:
    """``(sha256, encoding digest, token -> id, special tokens)`` of a tokenizer.json; cached
    per file version."""
    raw = Path(path).read_bytes()
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        message = f"{field}: {path} is not a tokenizer.json file (not JSON: {exc})"
        raise ConfigError(message) from None
    ids, special = _vocabulary(document, path, field)
    return hashlib.sha256(raw).hexdigest(), _encoding_digest(document), ids, special


def _encoding_digest(document: dict[str, object]) -> str:
    """sha256 of the parts of a tokenizer.json that decide the ids of a text encoded without
    special tokens (as Speedtronic encodes): normalizer, pre-tokenizer, model, added tokens,
    truncation and padding; not the post-processor, the decoder or the key order."""
    keys = ("normalizer", "pre_tokenizer", "model", "added_tokens", "truncation", "padding")
    parts = {key: document.get(key) for key in keys}
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _vocabulary(document: object, path: str, field: str) -> tuple[dict[str, int], set[str]]:
    """Token -> id (the model's vocabulary and the added tokens) and the special tokens."""
    document = document if isinstance(document, dict) else {}
    model = document.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids = {str(token): value for token, value in vocab.items() if isinstance(value, int)}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        ids = {str(entry[0]): index for index, entry in enumerate(vocab) if entry}
    else:
        raise ConfigError(
            f"{field}: {path} is not a tokenizer.json file (no model vocabulary); save one with "
            "tokenizers' Tokenizer.save() or use a Hub repo that has tokenizer.json"
        )
    added = [t for t in document.get("added_tokens") or () if isinstance(t, dict)]
    ids.update({str(t.get("content")): t["id"] for t in added if isinstance(t.get("id"), int)})
    if not ids or min(ids.values()) < 0:
        raise ConfigError(f"{field}: {path} has an empty or negative vocabulary")
    return ids, {str(t.get("content")) for t in added if t.get("special")}


def _configured_eos(config_path: Path) -> str | None:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None
