"""Datasets yielding causal-LM records ``{"input_ids": (T,), "labels": (T,)}`` (int64).

``labels[t]`` is the token after ``input_ids[t]`` (already shifted; models must not shift
again). Sources: deterministic synthetic tokens, a streamed UTF-8 text file, a flat token
stream (``.bin``/``.npy`` memory-mapped file or an in-memory tensor) cut into windows, and
fixed samples from a serialized tensor file.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from speedtronic.data.tokenizer import CharTokenizer, TokenizerLike, encode_text
from speedtronic.json_types import StateDict

if TYPE_CHECKING:
    from speedtronic.data.shards import TokenArray

__all__ = [
    "SampleTensorDataset",
    "SyntheticTokenDataset",
    "TextFileTokenDataset",
    "TokenFileDataset",
    "TokenWindowDataset",
]

Record = dict[str, torch.Tensor]

# Characters read per text chunk when none is given; bounds the memory of the stream.
DEFAULT_TEXT_CHUNK_CHARS = 1 << 16


def _record(window: torch.Tensor) -> Record:
    return {"input_ids": window[:-1], "labels": window[1:]}


class SyntheticTokenDataset(Dataset[Record]):
    """``num_samples`` random windows; item ``i`` depends only on ``seed + i``.

    Labels are uniform random, so the loss cannot fall far below ``ln(vocab_size)``: this
    is a throughput / smoke-test dataset. A subclass draws its windows another way by
    overriding :meth:`window` (``MarkovTokenDataset``).
    """

    def __init__(
        self,
        num_samples: int = 10_000,
        block_size: int = 128,
        vocab_size: int = 512,
        seed: int = 1234,
    ) -> None:
        if min(int(num_samples), int(block_size), int(vocab_size)) <= 0:
            raise ValueError("dataset sizes must be positive")
        self.num_samples = int(num_samples)
        self.block_size = int(block_size)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Record:
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(index)
        return _record(self.window(i))

    def window(self, index: int) -> torch.Tensor:
        """The ``block_size + 1`` int64 tokens of sample ``index`` (``0 <= index < len``)."""
        g = torch.Generator().manual_seed(self.seed + index)
        return torch.randint(self.vocab_size, (self.block_size + 1,), generator=g, dtype=torch.long)


class _ByteRange(io.RawIOBase):
    """A read-only view of ``length`` bytes of an open binary file from its current offset."""

    def __init__(self, handle: IO[bytes], length: int) -> None:
        super().__init__()
        self._handle = handle
        self._left = max(int(length), 0)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self._left)
        if size <= 0:
            return 0
        data = self._handle.read(size)
        buffer[: len(data)] = data
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        self._handle.close()
        super().close()


class TextFileTokenDataset(IterableDataset[Record]):
    """Stream a UTF-8 text file as disjoint windows of ``block_size + 1`` tokens.

    The file is read ``chunk_chars`` characters at a time (never whole); each chunk is
    tokenized on its own and appended to a carry buffer from which full windows are cut.
    A trailing partial window is dropped, so every record is exactly ``block_size`` long.
    With DataLoader workers, windows are dealt in groups of ``shard_group`` (the loader sets
    it to the batch size): group ``g`` goes to worker ``g % num_workers``, so no sample is
    produced twice and batches come out in the same order as without workers (each worker
    still reads the file). Invalid UTF-8 bytes are replaced. ``start_byte``/``stop_byte`` limit
    the stream to a byte range of the file (``eval.holdout`` keeps the tail for evaluation); a
    character cut at a range edge decodes as a replacement character.
    """

    shard_group: int = 1

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_size: int,
        tokenizer: TokenizerLike | None = None,
        vocab_size: int = 256,
        chunk_chars: int | None = None,
        *,
        start_byte: int = 0,
        stop_byte: int | None = None,
    ) -> None:
        if int(block_size) <= 0:
            raise ValueError("block_size must be positive")
        if int(start_byte) < 0 or (stop_byte is not None and int(stop_byte) < int(start_byte)):
            raise ValueError("byte range must satisfy 0 <= start_byte <= stop_byte")
        self.start_byte = int(start_byte)
        self.stop_byte = None if stop_byte is None else int(stop_byte)
        self.path = os.fspath(path)
        self.block_size = int(block_size)
        self.tokenizer = tokenizer or CharTokenizer(vocab_size)
        self.chunk_chars = int(chunk_chars or max(DEFAULT_TEXT_CHUNK_CHARS, 4 * self.block_size))
        if self.chunk_chars <= 0:
            raise ValueError("chunk_chars must be positive")

    def _open(self) -> IO[str]:
        if self.start_byte == 0 and self.stop_byte is None:
            return open(self.path, encoding="utf-8", errors="replace")
        raw = open(self.path, "rb")  # noqa: SIM115 - closed by the wrapper
        raw.seek(self.start_byte)
        stop = os.path.getsize(self.path) if self.stop_byte is None else self.stop_byte
        window = io.BufferedReader(_ByteRange(raw, stop - self.start_byte))
        return io.TextIOWrapper(window, encoding="utf-8", errors="replace")

    def token_chunks(self) -> Iterator[torch.Tensor]:
        """Yield the file's tokens chunk by chunk (int64 (N,) tensors, never the whole file).

        A chunk ends before the whitespace around its last newline (else its last space) and the
        rest is carried into the next one, so a subword tokenizer never sees a word cut in two
        (for the byte-level tokenizer this changes nothing). When the range reaches the end of
        the file, the tokenizer's end-of-text token (``eos_id``, if it has one) closes the
        document.
        """
        carry = ""
        with self._open() as handle:
            while True:
                text = handle.read(self.chunk_chars)
                if not text:
                    break
                text = carry + text
                cut = _last_break(text)
                text, carry = text[:cut], text[cut:]
                tokens = encode_text(self.tokenizer, text)
                if tokens.numel():
                    yield tokens
        if carry:
            yield encode_text(self.tokenizer, carry)
        eos = getattr(self.tokenizer, "eos_id", None)
        if eos is not None and (
            self.stop_byte is None or self.stop_byte >= os.path.getsize(self.path)
        ):
            yield torch.tensor([int(eos)], dtype=torch.long)

    def __iter__(self) -> Iterator[Record]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        span = self.block_size + 1
        carry = torch.empty(0, dtype=torch.long)
        index = 0
        for tokens in self.token_chunks():
            combined = torch.cat((carry, tokens)) if carry.numel() else tokens
            full = combined.numel() // span
            for j in range(full):
                if (index // self.shard_group) % workers == worker:
                    yield _record(combined[j * span : (j + 1) * span].clone())
                index += 1
            carry = combined[full * span :].clone()


def _last_break(text: str) -> int:
    """Where to cut ``text`` so no pre-token spans the cut: the start of the whitespace run
    around its last newline (else its last space); ``len(text)`` when there is none.

    The run goes to the next chunk whole, with the word after it (byte-level BPE attaches a
    leading space to the following word and keeps runs of newlines together).
    """
    index = text.rfind("\n")
    if index < 0:
        index = text.rfind(" ")
    while index > 0 and text[index - 1].isspace():
        index -= 1
    return index if index > 0 else len(text)


class TokenWindowDataset(Dataset[Record]):
    """Windows of ``block_size + 1`` tokens from a flat 1-D token stream.

    The index is the window's start offset (``0 <= start <= len(tokens) - block_size - 1``),
    so ``len()`` counts every possible window. ``build_dataloader`` pairs it with a
    ``TokenWindowSampler`` that picks random or sequential starts.
    """

    def __init__(self, tokens: TokenArray | None, block_size: int) -> None:
        if int(block_size) <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = int(block_size)
        self._tokens = tokens

    @property
    def tokens(self) -> TokenArray:
        """The 1-D token array (numpy array, memmap, tensor or prepared shards)."""
        assert self._tokens is not None  # given to the constructor (a token file: read lazily)
        return self._tokens

    @property
    def num_tokens(self) -> int:
        """Length of the token stream."""
        return len(self.tokens)

    def __len__(self) -> int:
        return max(self.num_tokens - self.block_size, 0)

    def __getitem__(self, start: int) -> Record:
        s = int(start)
        if not 0 <= s < len(self):
            raise IndexError(start)
        window = self.tokens[s : s + self.block_size + 1]
        if isinstance(window, torch.Tensor):
            return _record(window.to(torch.long))
        return _record(torch.from_numpy(np.asarray(window, dtype=np.int64)))


class TokenFileDataset(TokenWindowDataset):
    """``TokenWindowDataset`` over a memory-mapped ``.bin``/``.npy`` file or a prepared folder.

    The map is opened lazily in each process (DataLoader workers open their own), so the
    dataset pickles as a path, never as the token data. ``start``/``stop`` limit it to a token
    range of the file (``eval.holdout`` keeps the tail for evaluation).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_size: int,
        dtype: str = "uint16",
        *,
        start: int = 0,
        stop: int | None = None,
        split: str = "train",
    ):
        super().__init__(None, block_size)
        self.path = os.fspath(path)
        self.dtype = str(dtype)
        self.start = int(start)
        self.stop = None if stop is None else int(stop)
        self.split = split

    @property
    def tokens(self) -> TokenArray:
        if self._tokens is None:
            tokens = open_token_array(self.path, self.dtype, split=self.split)
            self._tokens = tokens[self.start : self.stop]
        return self._tokens

    def __getstate__(self) -> StateDict:
        state = dict(self.__dict__)
        state["_tokens"] = None
        return state


def open_token_array(path: str, dtype: str = "uint16", *, split: str = "train") -> TokenArray:
    """Memory-map a token file: ``.npy`` with its own dtype, anything else as raw ``dtype``.

    A folder written by ``speedtronic prepare`` gives all shards of ``split`` as one stream
    (a :class:`~speedtronic.data.shards.TokenShards`; its dtype comes from ``meta.json``).
    """
    if os.path.isdir(path):
        from speedtronic.data.shards import open_prepared

        return open_prepared(path, split, "data.token_path")
    if path.endswith(".npy"):
        array: np.ndarray = np.load(path, mmap_mode="r")
        return array
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


class SampleTensorDataset(Dataset[Record]):
    """Fixed samples: ``inputs`` and ``labels`` are (N, T) integer tensors."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        if inputs.shape != labels.shape or inputs.ndim != 2:
            raise ValueError("inputs and labels must be (samples, sequence) tensors of one shape")
        self.inputs = inputs.to(torch.long)
        self.labels = labels.to(torch.long)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> Record:
        return {"input_ids": self.inputs[index], "labels": self.labels[index]}
