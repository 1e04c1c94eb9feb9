"""Folders written by ``speedtronic prepare``: ``meta.json`` plus fixed-size token shards.

Layout (``meta.json`` is written last, atomically: a folder without it is not complete)::

    DIR/meta.json              format, tokenizer (spec, sha256, encoding, vocab_size, eos_id),
                               dtype, shard_tokens, documents, tokens, shards, sources, holdout
    DIR/train_000000.bin ...   raw little-endian uint16/uint32 tokens, documents separated
    DIR/eval_000000.bin ...    by the tokenizer's end-of-text token; eval = ``--holdout``

:class:`ShardWriter` writes the shards (``speedtronic.data.prepare``).
``open_prepared(DIR, "train")`` (``data.token_path: DIR``) and ``open_prepared(DIR, "eval")``
(``eval.token_path: DIR``) return a :class:`TokenShards`: every shard of the split as one
flat token stream, memory-mapped shard by shard on first use. Problems are ``ConfigError``s
naming the setting (``field``).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Union, overload

import numpy as np

from speedtronic.json_types import JSON, JSONView, StateDict

if TYPE_CHECKING:
    import torch
    from numpy.typing import DTypeLike

__all__ = [
    "FORMAT",
    "META",
    "SPLITS",
    "ShardWriter",
    "TokenShards",
    "fsync_dir",
    "open_prepared",
    "read_meta",
    "shard_name",
]

META = "meta.json"
FORMAT = "speedtronic.tokens"
SPLITS = ("train", "eval")


def _error(message: str) -> Exception:
    from speedtronic.config import ConfigError

    return ConfigError(message)


def shard_name(split: str, index: int) -> str:
    """File name of shard ``index`` of ``split`` (``train_000003.bin``)."""
    return f"{split}_{index:06d}.bin"


class TokenShards:
    """Read-only 1-D view over consecutive token shard files.

    ``len()`` is the number of tokens; ``view[a:b]`` is another view (no data is read);
    ``np.asarray(view)`` reads the tokens; ``view[i]`` is one token. Windows may cross shard
    boundaries (the shards are pieces of one stream). Pickles as paths, never as data.
    """

    def __init__(
        self,
        paths: Sequence[str],
        counts: Sequence[int],
        dtype: str,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self.paths = [str(p) for p in paths]
        self.counts = [int(c) for c in counts]
        self.dtype = np.dtype(dtype)
        self._ends = list(np.cumsum(self.counts, dtype=np.int64).tolist())
        total = self._ends[-1] if self._ends else 0
        self.start = max(0, min(int(start), total))
        self.stop = total if stop is None else max(self.start, min(int(stop), total))
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.stop - self.start

    def _view(self, start: int, stop: int) -> TokenShards:
        view = TokenShards([], [], self.dtype.name)
        view.paths, view.counts, view._ends = self.paths, self.counts, self._ends
        view.start, view.stop, view._maps = start, stop, self._maps
        return view

    @overload
    def __getitem__(self, key: slice) -> TokenShards: ...

    @overload
    def __getitem__(self, key: int) -> np.generic: ...

    def __getitem__(self, key: int | slice) -> TokenShards | np.generic:
        if isinstance(key, slice):
            begin, end, step = key.indices(len(self))
            if step != 1:
                raise ValueError("TokenShards supports contiguous slices only")
            return self._view(self.start + begin, self.start + max(begin, end))
        index = int(key)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(key)
        item: np.generic = self._read(self.start + index, self.start + index + 1)[0]
        return item

    def _map(self, shard: int) -> np.ndarray:
        array = self._maps.get(shard)
        if array is None:
            array = np.memmap(self.paths[shard], dtype=self.dtype, mode="r")
            self._maps[shard] = array
        return array

    def _read(self, begin: int, end: int) -> np.ndarray:
        """Tokens ``[begin, end)`` of the whole stream as one array."""
        pieces = []
        shard = bisect.bisect_right(self._ends, begin)
        while begin < end and shard < len(self.paths):
            first = self._ends[shard] - self.counts[shard]
            take = min(end, self._ends[shard])
            pieces.append(self._map(shard)[begin - first : take - first])
            begin, shard = take, shard + 1
        if not pieces:
            return np.empty(0, dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype: DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        data = np.asarray(self._read(self.start, self.stop))
        return data.astype(dtype) if dtype is not None else data

    def __getstate__(self) -> StateDict:
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state


TokenArray = Union[np.ndarray, "torch.Tensor", TokenShards]
"""A flat token stream: an array (or memory map), a tensor, or prepared shards."""


def read_meta(folder: str | os.PathLike[str], field: str) -> JSON:
    """The ``meta.json`` of a prepared folder (``ConfigError`` naming ``field`` when unusable)."""
    path = Path(folder) / META
    if not path.is_file():
        raise _error(
            f"{field}: {folder} has no {META}; it is not a complete folder written by "
            "speedtronic prepare (an interrupted run? re-run it to finish)"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _error(f"{field}: {path} is not readable JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _error(f"{field}: {path} is not a speedtronic prepare meta.json")
    return meta


def _recorded_marks(tokenizer: JSONView) -> set[object]:
    """The tokenizer marks a ``meta.json`` names: its file's sha256 and the digest of what it
    encodes. A folder prepared before the digest was recorded takes it from the tokenizer file
    it names, while that file still has the recorded sha256."""
    marks = {tokenizer.get("sha256"), tokenizer.get("encoding")} - {None}
    path = tokenizer.get("file")
    if tokenizer.get("encoding") is None and isinstance(path, str) and Path(path).is_file():
        from speedtronic.config.tokenizer_file import describe_tokenizer

        with contextlib.suppress(ValueError, OSError):
            info = describe_tokenizer(path)
            if info.sha256 == tokenizer.get("sha256"):
                marks.add(info.encoding)
    return marks


def open_prepared(
    folder: str | os.PathLike[str],
    split: str,
    field: str,
    *,
    vocab_size: int | None = None,
    tokenizer_marks: str | Sequence[str] | None = None,
) -> TokenShards:
    """All shards of ``split`` in a prepared folder, checked against the model and tokenizer.

    ``vocab_size``: the model's; a folder tokenized for more ids is refused. ``tokenizer_marks``:
    what identifies the configured tokenizer (``"bytes"`` for the byte tokenizer; for a
    ``tokenizer.json`` its file's sha256 and the digest of what it encodes,
    ``TokenizerInfo.encoding``); a folder whose ``meta.json`` names neither was made with
    another tokenizer and is refused. Missing or truncated shards are refused.
    """
    meta = read_meta(folder, field)
    tokenizer = meta.get("tokenizer") or {}
    marks = [tokenizer_marks] if isinstance(tokenizer_marks, str) else tokenizer_marks
    if marks is not None and not _recorded_marks(tokenizer) & set(marks):
        raise _error(
            f"{field}: {folder} was tokenized with {tokenizer.get('spec')!r} "
            f"(sha256 {str(tokenizer.get('sha256'))[:12]}), not with data.tokenizer; set "
            "data.tokenizer to the tokenizer the folder was prepared with"
        )
    folder_vocab = int(tokenizer.get("vocab_size") or 0)
    if vocab_size is not None and folder_vocab > int(vocab_size):
        raise _error(
            f"{field}: {folder} was tokenized for {folder_vocab} token ids but "
            f"model.vocab_size is {vocab_size}; set model.vocab_size to at least {folder_vocab}"
        )
    shards = (meta.get("shards") or {}).get(split) or []
    if not shards:
        hint = " (prepared without --holdout)" if split == "eval" else ""
        raise _error(f"{field}: {folder} has no {split} shards{hint}")
    dtype = np.dtype(str(meta.get("dtype")))
    paths, counts = [], []
    for entry in shards:
        path = Path(folder) / str(entry["file"])
        tokens = int(entry["tokens"])
        size = path.stat().st_size if path.is_file() else -1
        if size != tokens * dtype.itemsize:
            raise _error(
                f"{field}: shard {path} is missing or has {size} bytes, expected "
                f"{tokens * dtype.itemsize}; re-run speedtronic prepare --overwrite"
            )
        paths.append(str(path))
        counts.append(tokens)
    return TokenShards(paths, counts, dtype.name)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make renames inside ``folder`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ShardWriter:
    """Appends tokens to fixed-size shards ``<split>_NNNNNN.bin`` in ``folder``.

    The open shard is ``<name>.tmp``; it is fsynced and renamed when it holds
    ``shard_tokens`` tokens (or at :meth:`finish`), so a shard under its final name is always
    complete. :meth:`state` (after :meth:`sync`) and ``restore`` make an interrupted run resume
    exactly: the open shard is cut back to the length recorded with the state.
    """

    def __init__(
        self,
        folder: Path,
        split: str,
        dtype: str,
        shard_tokens: int,
        state: JSON | None = None,
    ) -> None:
        self.folder, self.split = Path(folder), split
        self.dtype = np.dtype(dtype)
        self.shard_tokens = int(shard_tokens)
        self.closed: list[JSON] = []
        self.open_tokens = 0
        self._handle: IO[bytes] | None = None
        if state:
            self._restore(state)

    def _name(self, index: int) -> Path:
        return self.folder / shard_name(self.split, index)

    def _restore(self, state: StateDict) -> None:
        self.closed = [dict(entry) for entry in state["closed"]]
        self.open_tokens = int(state["open_tokens"])
        final = self._name(len(self.closed))
        tmp = final.with_name(final.name + ".tmp")
        if final.exists() and not tmp.exists():
            os.replace(final, tmp)  # it was closed after the state was saved: reopen it
        if self.open_tokens:
            with open(tmp, "r+b") as handle:
                handle.truncate(self.open_tokens * self.dtype.itemsize)
        index = len(self.closed) + 1
        while self._name(index).exists() or self._name(index).with_suffix(".bin.tmp").exists():
            for stale in (self._name(index), self._name(index).with_suffix(".bin.tmp")):
                stale.unlink(missing_ok=True)
            index += 1

    def _open(self) -> IO[bytes]:
        if self._handle is None:
            final = self._name(len(self.closed))
            tmp = final.with_name(final.name + ".tmp")
            self._handle = open(tmp, "r+b" if self.open_tokens else "wb")  # noqa: SIM115
            self._handle.seek(self.open_tokens * self.dtype.itemsize)
        return self._handle

    def write(self, tokens: np.ndarray) -> int:
        """Append ``tokens``; returns how many shards this call closed."""
        data = np.asarray(tokens).astype(self.dtype, copy=False)
        closed = 0
        while data.size:
            take = min(self.shard_tokens - self.open_tokens, data.size)
            self._open().write(data[:take].tobytes())
            self.open_tokens += take
            data = data[take:]
            if self.open_tokens == self.shard_tokens:
                self._close_shard()
                closed += 1
        return closed

    def _close_shard(self) -> None:
        handle = self._open()
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        self._handle = None
        final = self._name(len(self.closed))
        os.replace(final.with_name(final.name + ".tmp"), final)
        self.closed.append({"file": final.name, "tokens": self.open_tokens})
        self.open_tokens = 0

    def sync(self) -> None:
        """Make the open shard's tokens durable (before saving :meth:`state`)."""
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())

    def state(self) -> JSON:
        """Closed shards and the open shard's length (JSON-ready)."""
        return {"closed": [dict(e) for e in self.closed], "open_tokens": self.open_tokens}

    def finish(self) -> list[JSON]:
        """Close the last, shorter shard; returns every shard ``{"file", "tokens"}``."""
        if self.open_tokens:
            self._close_shard()
        elif self._handle is not None:
            self._handle.close()
            self._handle = None
        return [dict(e) for e in self.closed]

    def close(self) -> None:
        """Release the open file without closing the shard (the state stays resumable)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
