"""The inputs of ``speedtronic prepare``: sources, work units, and encoding one unit.

A **source** is one input file: JSON Lines (``.jsonl``/``.ndjson``; each record's text field is
a document), Parquet (``.parquet``; each row's text column is a document, read with pyarrow one
record batch at a time) or plain text (anything else; the whole file is one document). Folders
are walked recursively in sorted order, skipping hidden names. A **unit** is a piece of a source
of about ``unit_bytes`` bytes, cut before the whitespace around a newline (text without
newlines: before a space, else at a character boundary), so memory stays bounded whatever the
file size; JSONL units hold whole lines, Parquet units whole rows (their texts framed by
:func:`frame_records`). Units are cut from the bytes alone, so the token stream does not depend
on how many processes encode them.

:func:`encode_units` runs in a worker process (or in-process for one worker) with the tokenizer
installed by :func:`init_worker`; it never raises for bad input but returns the problem, which
the caller turns into an error naming the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Encoded",
    "PrepareError",
    "Source",
    "Unit",
    "check_parquet_field",
    "collect_sources",
    "encode_units",
    "frame_records",
    "init_worker",
    "iter_units",
    "unframe_records",
]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_EXTRA = "reading Parquet needs pyarrow: pip install 'speedtronic[parquet]'"
_PARQUET_BATCH_ROWS = 1024
_FRAME = 4  # bytes of the little-endian length before each framed record
_BINARY_PROBE = 8192
_REPLACEMENT = "\ufffd"
_WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")


class PrepareError(ValueError):
    """Bad input to ``speedtronic prepare`` (the CLI exits 2 with this one-line message)."""


@dataclass(frozen=True)
class Source:
    """One input file: ``kind`` is ``text``, ``jsonl`` or ``parquet``; size and mtime
    fingerprint it (for Parquet, ``size`` is the file's, compressed)."""

    path: str
    kind: str
    size: int
    mtime_ns: int


@dataclass
class Unit:
    """Bytes ``[offset, offset + len(data))`` of source ``source``; ``last`` ends the file.

    For Parquet, ``data`` holds whole rows (:func:`frame_records`), ``offset`` is the first row
    (from 0) and ``first_line`` the same row counted from 1; ``rows`` is the row (from 0) of
    each framed record (empty and null rows are not framed). ``span`` is how many bytes of the
    input file the unit accounts for (its length, except for Parquet: a share of the file).
    """

    index: int
    source: int
    data: bytes
    offset: int
    first_line: int
    last: bool
    span: int = -1
    rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.span < 0:
            self.span = len(self.data)


@dataclass
class Encoded:
    """One unit's tokens: ``lengths[i]`` tokens per document piece, in order.

    A text unit has one piece (the end-of-text token closes it when the unit ends the file);
    a JSONL unit one per record. ``error`` is ``None`` or ``(where, message)``: a byte offset
    within the unit for text, a line within the unit (from 0) for JSONL, a record within the
    unit (from 0) for Parquet.
    """

    tokens: np.ndarray
    lengths: list[int] = field(default_factory=list)
    replaced: int = 0
    error: tuple[int, str] | None = None


def _walk(folder: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(root) / name


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as handle:
        return b"\x00" in handle.read(_BINARY_PROBE)


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "jsonl" if suffix in JSONL_SUFFIXES else "text"


def _parquet_file(path: str) -> Any:
    """``pyarrow.parquet.ParquetFile(path)``; a missing pyarrow or a bad file is a
    :class:`PrepareError` naming the extra or the file."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(PARQUET_EXTRA) from None
    try:
        # pre_buffer off: with it, pyarrow keeps the buffered column chunks of every row group
        # read so far, and memory grows with the file (bench/prepare_parquet.py).
        return pq.ParquetFile(path, pre_buffer=False)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a non-Parquet file
        raise PrepareError(f"input {path} is not a readable Parquet file ({exc})") from None


def check_parquet_field(sources: Sequence[Source], text_field: str) -> None:
    """Every Parquet source has a string column ``text_field`` (else a :class:`PrepareError`
    listing the columns), checked from the footers before any row is read."""
    for source in sources:
        if source.kind != "parquet":
            continue
        schema = _parquet_file(source.path).schema_arrow
        if text_field not in schema.names:
            columns = ", ".join(schema.names[:8]) or "none"
            raise PrepareError(
                f"{source.path}: no {text_field!r} column (columns: {columns}); "
                "choose one with --field"
            )
        kind = str(schema.field(text_field).type)
        if kind not in ("string", "large_string", "string_view"):
            raise PrepareError(
                f"{source.path}: column {text_field!r} is {kind}, expected a string column"
            )


def collect_sources(inputs: Sequence[str]) -> tuple[list[Source], int]:
    """The files behind ``inputs`` (files and folders) and how many empty files were skipped.

    An input that does not exist, an empty file named explicitly, a folder without any
    non-empty file, and a binary file (NUL bytes in its first 8 KiB) are ``PrepareError``s.
    """
    if not inputs:
        raise PrepareError("no --input given")
    sources: list[Source] = []
    skipped = 0
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files = list(_walk(path))
            found = [f for f in files if f.is_file() and f.stat().st_size > 0]
            skipped += len(files) - len(found)
            if not found:
                raise PrepareError(f"input folder {item} holds no non-empty files")
        elif path.is_file():
            if path.stat().st_size == 0:
                raise PrepareError(f"input {item} is empty")
            found = [path]
        else:
            raise PrepareError(f"input not found: {item}")
        for file in found:
            kind = _kind(file)
            if kind != "parquet" and _looks_binary(file):
                raise PrepareError(
                    f"input {file} looks binary (NUL bytes in its first 8 KiB); remove it "
                    "from the inputs or name the text files one by one"
                )
            stat = file.stat()
            sources.append(Source(str(file), kind, stat.st_size, stat.st_mtime_ns))
    return sources, skipped


def _cut(buffer: bytes, kind: str) -> int:
    """Where a unit ends inside ``buffer`` (a full buffer that is not the end of its file).

    JSONL: after the last newline (0: the line goes on, read more). Text: at the start of the
    whitespace run around the last newline (else the last space), as text streaming cuts its
    chunks, so no word or whitespace run is split; else at a UTF-8 character boundary.
    """
    if kind == "jsonl":
        return buffer.rfind(b"\n") + 1
    index = buffer.rfind(b"\n")
    if index < 0:
        index = buffer.rfind(b" ")
    while index > 0 and buffer[index - 1] in _WHITESPACE:
        index -= 1
    if index > 0:
        return index
    cut = len(buffer)
    while cut > 0 and buffer[cut - 1] & 0xC0 == 0x80:  # back off UTF-8 continuation bytes
        cut -= 1
    if cut > 0 and buffer[cut - 1] >= 0xC0:  # a lead byte whose sequence was cut
        cut -= 1
    return cut or len(buffer)


def frame_records(texts: Sequence[bytes]) -> bytes:
    """UTF-8 records as one buffer: each one's length (4 bytes, little-endian), then its bytes."""
    return b"".join(len(t).to_bytes(_FRAME, "little") + t for t in texts)


def unframe_records(data: bytes) -> list[bytes]:
    """The records :func:`frame_records` wrote, in order."""
    records, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + _FRAME], "little")
        at += _FRAME
        records.append(data[at : at + size])
        at += size
    return records


def _parquet_units(source: Source, text_field: str, unit_bytes: int) -> Iterator[Unit]:
    """One Parquet file as units of whole rows (about ``unit_bytes`` of text each).

    Rows are read one record batch at a time, so memory is one batch plus one unit whatever
    the file size; null texts are skipped like empty ones. The texts travel as their bytes
    (the column read as binary): a Parquet writer need not have checked that they are UTF-8,
    so they are decoded under ``--utf8`` like any other input. ``Unit.index``/``source`` are
    filled in by :func:`iter_units`.
    """
    import pyarrow as pa

    handle = _parquet_file(source.path)
    total_rows = max(1, handle.metadata.num_rows)
    pending: list[bytes] = []
    rows: list[int] = []
    size, first, row, spent = 0, 0, 0, 0
    batches = handle.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field])
    for batch in batches:
        for data in batch.column(0).cast(pa.large_binary()).to_pylist():
            if data:
                pending.append(data)
                rows.append(row)
                size += len(data) + _FRAME
            row += 1
            if size >= unit_bytes:
                share = source.size * row // total_rows - spent
                spent += share
                yield Unit(-1, -1, frame_records(pending), first, first + 1, False, share, rows)
                pending, rows, size, first = [], [], 0, row
    last = source.size - spent
    yield Unit(-1, -1, frame_records(pending), first, first + 1, True, last, rows)


def iter_units(
    sources: Sequence[Source], unit_bytes: int, text_field: str = "text"
) -> Iterator[Unit]:
    """Every unit of every source, in order (memory: about ``unit_bytes`` plus one line or
    one Parquet record batch)."""
    index = 0
    for number, source in enumerate(sources):
        if source.kind == "parquet":
            for unit in _parquet_units(source, text_field, unit_bytes):
                unit.index, unit.source = index, number
                yield unit
                index += 1
            continue
        offset, line = 0, 1
        carry = b""
        with open(source.path, "rb") as handle:
            while True:
                want = unit_bytes - len(carry) if len(carry) < unit_bytes else unit_bytes
                more = handle.read(want)
                buffer = carry + more
                if not more:
                    if buffer:
                        yield Unit(index, number, buffer, offset, line, True)
                        index += 1
                    break
                if len(buffer) < unit_bytes:
                    carry = buffer
                    continue
                cut = _cut(buffer, source.kind)
                if cut == 0:
                    carry = buffer  # a JSONL line longer than a unit: keep reading
                    continue
                data, carry = buffer[:cut], buffer[cut:]
                at_end = not carry and handle.tell() >= os.fstat(handle.fileno()).st_size
                yield Unit(index, number, data, offset, line, at_end)
                index += 1
                offset += len(data)
                line += data.count(b"\n")
                if at_end:
                    break


# ----------------------------------------------------------------------------- worker side
_Encode = Callable[[list[str], list[int | None]], list[np.ndarray]]
"""Texts and each one's end-of-text id (or None) -> their token arrays."""
_STATE: dict[str, Any] = {}  # this worker's "encode" (an _Encode) and "eos"


def init_worker(tokenizer_json: str | None, eos_id: int | None, single_thread: bool) -> None:
    """Install the tokenizer of this process (``None``: bytes). Called once per worker."""
    if single_thread:  # N processes already use the cores; keep tokenizers' pool to one
        os.environ["RAYON_RS_NUM_CPUS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if tokenizer_json is None:
        _STATE["encode"] = _encode_bytes
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(tokenizer_json)
        batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        _STATE["encode"] = lambda texts, ends: [
            _array(e.ids, end)
            for e, end in zip(batch(texts, add_special_tokens=False), ends, strict=True)
        ]
    _STATE["eos"] = eos_id


def _encode_bytes(texts: list[str], ends: list[int | None]) -> list[np.ndarray]:
    return [_array(list(t.encode("utf-8")), end) for t, end in zip(texts, ends, strict=True)]


def _array(ids: list[int], eos: int | None) -> np.ndarray:
    """``ids`` (+ ``eos`` when not ``None``) as uint32; the list is dropped right away."""
    if eos is not None:
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint32)


def _decode(data: bytes, strict: bool) -> tuple[str, int, int | None]:
    """``(text, replaced sequences, offset of the first bad byte when strict)``."""
    try:
        return data.decode("utf-8"), 0, None
    except UnicodeDecodeError as exc:
        if strict:
            return "", 0, exc.start
    text = data.decode("utf-8", errors="replace")
    replaced = text.count(_REPLACEMENT) - data.count(_REPLACEMENT.encode("utf-8"))
    return text, replaced, None


def encode_units(
    jobs: list[tuple[str, bytes, bool]], text_field: str, strict: bool
) -> list[Encoded]:
    """Tokenize units ``(kind, data, last)`` (see :class:`Encoded`), in order.

    Runs where :func:`init_worker` ran. The text units of a call share one batch call of the
    tokenizer (small files are cheap to encode together); a JSONL unit batches its records.
    """
    encode, eos = _STATE["encode"], _STATE["eos"]
    results: list[Encoded | None] = [None] * len(jobs)
    texts: list[tuple[int, str, int]] = []
    for position, (kind, data, _last) in enumerate(jobs):
        if kind == "parquet":
            results[position] = _encode_records(unframe_records(data), strict, encode, eos)
            continue
        if kind != "text":
            results[position] = _encode_jsonl(data, text_field, strict, encode, eos)
            continue
        text, replaced, bad = _decode(data, strict)
        if bad is not None:
            results[position] = Encoded(np.empty(0, np.uint32), error=(bad, "invalid UTF-8"))
        else:
            texts.append((position, text.replace("\r\n", "\n").replace("\r", "\n"), replaced))
    ends = [eos if jobs[position][2] else None for position, _, _ in texts]
    pieces = encode([text for _, text, _ in texts], ends) if texts else []
    for (position, _, replaced), tokens in zip(texts, pieces, strict=True):
        results[position] = Encoded(tokens, [len(tokens)], replaced)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _encode_records(
    records: list[bytes], strict: bool, encode: _Encode, eos: int | None
) -> Encoded:
    """Framed Parquet texts as one :class:`Encoded`; invalid UTF-8 is replaced and counted,
    or with ``strict`` the unit's error names the record (from 0)."""
    texts, replaced = [], 0
    for number, record in enumerate(records):
        text, count, bad = _decode(record, strict)
        if bad is not None:
            return Encoded(np.empty(0, np.uint32), error=(number, "invalid UTF-8"))
        replaced += count
        texts.append(text.replace("\r\n", "\n"))
    return _joined(texts, encode, eos, replaced)


def _joined(texts: list[str], encode: _Encode, eos: int | None, replaced: int) -> Encoded:
    pieces = encode(texts, [eos] * len(texts)) if texts else []
    tokens = np.concatenate(pieces) if pieces else np.empty(0, np.uint32)
    return Encoded(tokens, [len(p) for p in pieces], replaced)


def _encode_jsonl(
    data: bytes, text_field: str, strict: bool, encode: _Encode, eos: int | None
) -> Encoded:
    texts, replaced = [], 0
    for number, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        line, bad_count, bad = _decode(raw, strict)
        if bad is not None:
            return Encoded(np.empty(0, np.uint32), error=(number, "invalid UTF-8"))
        replaced += bad_count
        text, problem = _record_text(line, text_field)
        if problem:
            return Encoded(np.empty(0, np.uint32), error=(number, problem))
        if text:
            texts.append(text)
    return _joined(texts, encode, eos, replaced)


def _record_text(line: str, text_field: str) -> tuple[str, str | None]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        return "", f"not valid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(record, dict):
        return "", f"a JSON {type(record).__name__}, expected an object with a {text_field!r} field"
    if text_field not in record:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        return "", f"no {text_field!r} field (fields: {keys}); choose one with --field"
    value = record[text_field]
    if not isinstance(value, str):
        return "", f"field {text_field!r} is a {type(value).__name__}, expected a string"
    return value, None
