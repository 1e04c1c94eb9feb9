"""Tokenizers behind ``data.tokenizer``: byte-level ``CharTokenizer`` and ``HFTokenizer``.

``load_tokenizer("bytes")`` is the byte-level tokenizer (token = UTF-8 byte, no end-of-text
token, today's ``text_path`` behaviour); any other value names a Hugging Face ``tokenizer.json``
(a path, a folder holding one, or a Hub repo id; see :mod:`speedtronic.config.tokenizer_file`)
loaded with the ``tokenizers`` library. Both encode text without adding special tokens;
callers append :attr:`eos_id` after each document. ``tokenizer_for(config)`` is the tokenizer
of a ``SpeedtronicConfig``: the one text streaming, eval, ``prepare`` and ``sample`` all use.

A tokenizer travels with a checkpoint: :func:`tokenizer_record` is what a checkpoint stores
(the file's text, the ``tokenizer_config.json`` beside it, the hash) and
:func:`materialize_tokenizer` writes such a record back to a folder (a per-user cache keyed by
the hash) that ``data.tokenizer`` can name, wherever the checkpoint was moved.

This module imports neither torch nor ``tokenizers`` at import time.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, SupportsInt, runtime_checkable

import numpy as np

from speedtronic.config import SpeedtronicConfig
from speedtronic.config.tokenizer_file import TokenizerInfo, describe_tokenizer, is_bytes
from speedtronic.json_types import StateDict

if TYPE_CHECKING:
    import tokenizers
    import torch

__all__ = [
    "CharTokenizer",
    "Encoder",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerLike",
    "encode_text",
    "load_tokenizer",
    "materialize_tokenizer",
    "tokenizer_for",
    "tokenizer_record",
]


class CharTokenizer:
    """Byte-level tokenizer: each UTF-8 byte ``b`` becomes token ``b % vocab_size``.

    Despite the name it works on bytes, not characters; it is lossy when ``vocab_size < 256``
    and has no special tokens (``eos_id`` is ``None``: documents are simply concatenated).
    """

    spec = "bytes"
    sha256 = "bytes"
    encoding = "bytes"
    eos_id: int | None = None
    eos_token: str | None = None

    def __init__(self, vocab_size: int = 256) -> None:
        if int(vocab_size) <= 0:
            raise ValueError("vocab_size must be positive")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a Python list."""
        return [b % self.vocab_size for b in text.encode("utf-8")]

    __call__ = encode

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as a 1-D uint32 array (vectorised, same values as ``encode``)."""
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
        if self.vocab_size < 256:
            data %= self.vocab_size
        return data

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode_array`` of each text."""
        return [self.encode_array(text) for text in texts]

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor (same values as ``encode``)."""
        import torch

        return torch.from_numpy(self.encode_array(text).astype(np.int64))

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        """Bytes back to text (ids above 255 are dropped; invalid UTF-8 becomes U+FFFD)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json``; see the module docstring.

    ``vocab_size`` is the number of ids it can emit (highest id + 1), ``eos_id`` its
    end-of-text token (``None`` when it has none), ``sha256`` the file's hash and ``encoding``
    the digest of what it encodes (both recorded by ``prepare``; a prepared folder is read with
    a tokenizer that matches either). Pickles as its JSON text.
    """

    def __init__(self, info: TokenizerInfo, *, field: str = "data.tokenizer") -> None:
        self.info = info
        self._tokenizer = _parse(info.path.read_text(encoding="utf-8"), str(info.path), field)

    spec = property(lambda self: self.info.spec)
    sha256 = property(lambda self: self.info.sha256)
    encoding = property(lambda self: self.info.encoding)
    vocab_size = property(lambda self: self.info.vocab_size)
    eos_id = property(lambda self: self.info.eos_id)
    eos_token = property(lambda self: self.info.eos_token)

    def to_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text."""
        return self._tokenizer.to_str()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    __call__ = encode

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as a 1-D uint32 array."""
        return np.asarray(self.encode(text), dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (one ``encode_batch`` call: parallel inside ``tokenizers``)."""
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor."""
        import torch

        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        """Text of ``ids`` (special tokens are left out)."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __getstate__(self) -> StateDict:
        return {"info": self.info, "json": self.to_str()}

    def __setstate__(self, state: StateDict) -> None:
        self.info = state["info"]
        self._tokenizer = _parse(state["json"], str(self.info.path), "data.tokenizer")


def _parse(text: str, where: str, field: str) -> tokenizers.Tokenizer:
    from speedtronic.config import ConfigError

    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - a declared dependency
        message = f"{field}: the tokenizers package is needed (pip install tokenizers)"
        raise ConfigError(message) from exc
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{field}: {where} does not parse as a tokenizer: {detail}") from None


Tokenizer = CharTokenizer | HFTokenizer
"""The package's tokenizers."""


@runtime_checkable
class Encoder(Protocol):
    """A user's tokenizer: anything with ``encode(text)`` (docs/data.md)."""

    def encode(self, text: str) -> Iterable[SupportsInt]:
        """Token ids of ``text``."""


TokenizerLike = Tokenizer | Encoder | Callable[[str], Iterable[SupportsInt]]
"""What the data path takes: a package tokenizer, an ``Encoder``, or a callable."""


@functools.lru_cache(maxsize=8)
def _load_file(info: TokenizerInfo, field: str) -> HFTokenizer:
    return HFTokenizer(info, field=field)


def load_tokenizer(
    spec: str | None,
    *,
    vocab_size: int | None = None,
    token: str | None = None,
    field: str = "data.tokenizer",
) -> Tokenizer:
    """The tokenizer ``spec`` names (``bytes``/``None``: byte-level, ids ``b % vocab_size``).

    A bad file, a missing file or an unreachable Hub repo is a ``ConfigError`` naming ``field``.
    """
    if is_bytes(spec):
        return CharTokenizer(vocab_size or 256)
    return _load_file(describe_tokenizer(str(spec), field=field, token=token), field)


def tokenizer_for(config: SpeedtronicConfig) -> Tokenizer:
    """The tokenizer of a ``SpeedtronicConfig`` (``data.tokenizer``, ``model.vocab_size``)."""
    return load_tokenizer(
        config.data.tokenizer,
        vocab_size=config.model.vocab_size,
        token=config.distributed.token,
    )


@runtime_checkable
class _TensorEncoder(Protocol):
    def encode_tensor(self, text: str) -> torch.Tensor: ...


def encode_text(tokenizer: TokenizerLike, text: str) -> torch.Tensor:
    """Tokenize ``text`` with any tokenizer (``encode`` method or callable) into int64 (N,)."""
    import torch

    if isinstance(tokenizer, _TensorEncoder):
        return tokenizer.encode_tensor(text)
    ids = tokenizer.encode(text) if isinstance(tokenizer, Encoder) else tokenizer(text)
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return torch.tensor([int(i) for i in ids], dtype=torch.long)


def tokenizer_record(spec: object, *, token: str | None = None) -> dict[str, str | None] | None:
    """What a checkpoint stores so its tokenizer travels with it: ``{"spec", "sha256",
    "json", "config"}`` (the ``tokenizer.json`` text and the ``tokenizer_config.json`` text
    beside it, or ``None``); ``None`` for the byte-level tokenizer, whose settings are the
    config's."""
    if is_bytes(spec):
        return None
    info = describe_tokenizer(str(spec), token=token)
    config_text = info.config_path.read_text(encoding="utf-8") if info.config_path else None
    return {
        "spec": info.spec,
        "sha256": info.sha256,
        "json": info.path.read_text(encoding="utf-8"),
        "config": config_text,
    }


def _cache_root() -> Path:
    return Path.home() / ".cache" / "speedtronic" / "tokenizers"


def materialize_tokenizer(record: object) -> Path | None:
    """A folder holding the ``tokenizer.json`` (and ``tokenizer_config.json``) of a
    :func:`tokenizer_record`, for ``data.tokenizer``; ``None`` when ``record`` is not one.

    The folder is ``~/.cache/speedtronic/tokenizers/<sha256 of the files>`` (a private
    temporary folder when the home cache cannot be written); a file there whose bytes differ
    is rewritten."""
    if not isinstance(record, dict) or not isinstance(record.get("json"), str):
        return None
    files = {"tokenizer.json": record["json"]}
    if isinstance(record.get("config"), str):
        files["tokenizer_config.json"] = record["config"]
    digest = hashlib.sha256("\0".join(files.values()).encode("utf-8")).hexdigest()
    try:
        return _write_folder(_cache_root() / digest, files)
    except (OSError, RuntimeError):  # no home directory, or a read-only one
        import tempfile

        return _write_folder(Path(tempfile.mkdtemp(prefix="speedtronic-tokenizer-")), files)


def _write_folder(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = folder / name
        data = text.encode("utf-8")
        if path.is_file() and path.read_bytes() == data:
            continue
        temp = path.with_name(f".{name}.tmp-{os.getpid()}")
        temp.write_bytes(data)
        os.replace(temp, path)
    return folder
