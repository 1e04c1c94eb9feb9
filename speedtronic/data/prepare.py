"""``speedtronic prepare``: text files, JSON Lines and Parquet to token shards plus ``meta.json``.

::

    result = prepare(["corpus/"], "tokens/", tokenizer="tokenizer.json", holdout=0.01, workers=4)

Inputs are read as units of about ``unit_bytes`` (:mod:`speedtronic.data.units`), tokenized by
``workers`` processes (1: in this process) and written **in input order** by this process, so
any number of workers gives the same bytes. Each document (a text file, a JSONL record, a
Parquet row) is followed by the tokenizer's end-of-text token. Document ``i`` (counted from 0
over all inputs) is held out when ``floor((i + 1) * holdout) > floor(i * holdout)``: exactly
a ``holdout`` fraction, spread evenly, without knowing the corpus size in advance. Shards hold
``shard_tokens`` tokens (the last of each split fewer): uint16 when the vocabulary fits, else
uint32. Memory is bounded by the unit size times the units in flight, not by the corpus.

Work happens in ``DIR/.partial/``: shards are written as ``.tmp`` files and renamed when full,
and ``progress.json`` records, at unit boundaries, how far the run got. A re-run of the same
inputs and settings resumes from there; a re-run of other inputs starts clean; both say so
through ``log``. Only a finished run moves its shards into ``DIR`` and writes ``DIR/meta.json``
(atomically, last), so an interrupted run never looks complete and an existing corpus in
``DIR`` stays intact until the new one is whole. A ``DIR`` holding another corpus (or foreign
files) is refused unless ``overwrite``. Bad input raises :class:`PrepareError`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from speedtronic.data.shards import FORMAT, META, ShardWriter, fsync_dir
from speedtronic.data.units import (
    Encoded,
    PrepareError,
    Unit,
    check_parquet_field,
    collect_sources,
    encode_units,
    init_worker,
    iter_units,
)
from speedtronic.json_types import JSON

__all__ = ["DEFAULT_SHARD_TOKENS", "PrepareError", "PrepareResult", "prepare"]

DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB per uint16 shard
DEFAULT_UNIT_BYTES = 1 << 20  # a tokenizer call holds ~30 bytes per input byte: ~30 MB
PARTIAL = ".partial"
_SHARD_FILE = re.compile(r"^(train|eval)_\d{6}\.bin$")
_CHECKPOINT_SECONDS = 5.0


@dataclass
class PrepareResult:
    """What ``prepare`` did: ``status`` is ``written``, ``resumed`` or ``unchanged``."""

    output: Path
    meta: JSON
    status: str


def _write_json(path: Path, payload: JSON) -> None:
    """Atomic JSON write: temp file, fsync, rename, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _read_json(path: Path) -> JSON | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class _Run:
    """One prepare run: settings, output checks, the unit loop, resume and finalisation."""

    def __init__(self, inputs: Sequence[str], output: str | os.PathLike[str], **opts: Any):
        from speedtronic.data.tokenizer import load_tokenizer

        self.output = Path(output)
        self.log: Callable[[str], None] = opts["log"] or (lambda message: None)
        self.progress = opts["progress"]
        self.workers = int(opts["workers"])
        self.shard_tokens = int(opts["shard_tokens"])
        self.unit_bytes = int(opts["unit_bytes"])
        self.field, self.strict = str(opts["field"]), opts["utf8"] == "strict"
        try:
            self.holdout = Fraction(str(opts["holdout"])).limit_denominator(10**6)
        except (ValueError, ZeroDivisionError):
            message = f"--holdout must be a number in [0, 1), got {opts['holdout']!r}"
            raise PrepareError(message) from None
        if not 0 <= self.holdout < 1:
            raise PrepareError(f"--holdout must be in [0, 1), got {opts['holdout']}")
        if self.workers < 1 or self.shard_tokens < 1 or self.unit_bytes < 1:
            raise PrepareError("--workers, --shard-tokens and the unit size must be positive")
        try:
            self.tokenizer = load_tokenizer(opts["tokenizer"], field="--tokenizer", token=None)
        except ValueError as exc:
            raise PrepareError(str(exc).replace("--tokenizer: ", "--tokenizer ", 1)) from None
        self.vocab_file = self.tokenizer.spec != "bytes"
        self.vocab = int(self.tokenizer.vocab_size) if self.vocab_file else 256
        self.dtype = "uint16" if self.vocab <= 1 << 16 else "uint32"
        self.sources, self.skipped = collect_sources(inputs)
        check_parquet_field(self.sources, self.field)
        self.partial = self.output / PARTIAL
        self.fingerprint = self._fingerprint()

    # ------------------------------------------------------------------ identity / checks
    def _fingerprint(self) -> str:
        settings = {
            "format": FORMAT,
            "tokenizer": self.tokenizer.sha256,
            "field": self.field,
            "holdout": str(self.holdout),
            "shard_tokens": self.shard_tokens,
            "unit_bytes": self.unit_bytes,
            "utf8": self.strict,
            "sources": [[s.path, s.kind, s.size, s.mtime_ns] for s in self.sources],
        }
        return hashlib.sha256(json.dumps(settings).encode()).hexdigest()

    def check_output(self, overwrite: bool) -> JSON | None:
        """The finished meta when ``DIR`` already holds this corpus; refuses other contents."""
        if self.output.exists() and not self.output.is_dir():
            raise PrepareError(f"--output {self.output} is a file, expected a folder")
        if not self.output.exists():
            return None
        meta = _read_json(self.output / META)
        if meta is not None and meta.get("fingerprint") == self.fingerprint:
            return meta
        if overwrite:
            return None
        if meta is not None:
            raise PrepareError(
                f"--output {self.output} holds a corpus of other inputs or settings "
                f"({sum((meta.get('tokens') or {}).values())} tokens "
                f"from {len(meta.get('sources') or [])} files, tokenizer "
                f"{(meta.get('tokenizer') or {}).get('spec')!r}); pass --overwrite to replace "
                "it or choose another folder"
            )
        others = sorted(p.name for p in self.output.iterdir() if p.name != PARTIAL)
        if others:
            raise PrepareError(
                f"--output {self.output} is not empty and is not a prepared folder (it holds "
                f"{len(others)} entries, e.g. {others[0]}); pass --overwrite to write the "
                "shards there anyway or choose an empty folder"
            )
        return None

    # ------------------------------------------------------------------ resume
    def _resume_state(self) -> JSON | None:
        if not self.partial.exists():
            return None
        state = _read_json(self.partial / "progress.json")
        if state is None:
            self.log(f"starting clean: {self.partial} holds no usable progress record")
        elif state.get("fingerprint") != self.fingerprint:
            self.log(
                f"starting clean: {self.partial} held an interrupted run of other inputs or "
                "settings; removed it"
            )
            state = None
        elif not self._files_match(state):
            self.log(f"starting clean: the files in {self.partial} do not match its progress")
            state = None
        if state is None:
            shutil.rmtree(self.partial)
        return state

    def _files_match(self, state: JSON) -> bool:
        if state.get("finalizing"):
            return True
        itemsize = np.dtype(self.dtype).itemsize
        for writer in state["writers"].values():
            for entry in writer["closed"]:
                path = self.partial / entry["file"]
                if not path.is_file() or path.stat().st_size != entry["tokens"] * itemsize:
                    return False
            if writer["open_tokens"]:
                name = f"{writer['split']}_{len(writer['closed']):06d}.bin"
                sizes = [
                    p.stat().st_size
                    for p in (self.partial / name, self.partial / (name + ".tmp"))
                    if p.is_file()
                ]
                if not sizes or max(sizes) < writer["open_tokens"] * itemsize:
                    return False
        return True

    # ------------------------------------------------------------------ the loop
    def run(self, overwrite: bool, on_start: Callable[[int], None] | None) -> PrepareResult:
        done = self.check_output(overwrite)
        if done is not None:
            self.log(f"{self.output} already holds this corpus (meta.json); nothing to do")
            return PrepareResult(self.output, done, "unchanged")
        self.output.mkdir(parents=True, exist_ok=True)
        state = self._resume_state()
        resumed = state is not None
        if state is None:
            self.partial.mkdir()
            state = self._new_state()
            _write_json(self.partial / "progress.json", state)
        elif not state.get("finalizing"):
            done_docs = sum(state["documents"].values())
            self.log(
                f"resuming the interrupted run in {self.partial}: "
                f"{sum(len(w['closed']) for w in state['writers'].values())} shards kept, "
                f"continuing after {done_docs} documents"
            )
        if self.tokenizer.eos_id is None and self.tokenizer.spec != "bytes":
            self.log(f"{self.tokenizer.spec} has no end-of-text token: documents are not separated")
        if on_start is not None:
            on_start(sum(s.size for s in self.sources))
        if self.progress is not None and state["bytes"]:
            self.progress(state["bytes"], 0)  # what the interrupted run already did
        if not state.get("finalizing"):
            self._encode_all(state)
        try:
            meta = self._finalize(state)
        except PrepareError:
            shutil.rmtree(self.partial, ignore_errors=True)
            raise
        return PrepareResult(self.output, meta, "resumed" if resumed else "written")

    def _new_state(self) -> JSON:
        empty = {"closed": [], "open_tokens": 0}
        return {
            "fingerprint": self.fingerprint,
            "next_unit": 0,
            "documents": {"train": 0, "eval": 0},
            "tokens": {"train": 0, "eval": 0},
            "bytes": 0,
            "sources": [[0, 0, 0] for _ in self.sources],  # documents, tokens, replaced
            "writers": {s: {**empty, "split": s} for s in ("train", "eval")},
        }

    def _encode_all(self, state: JSON) -> None:
        writers = {
            split: ShardWriter(self.partial, split, self.dtype, self.shard_tokens, saved)
            for split, saved in state["writers"].items()
        }
        last_save, pending_closed = time.monotonic(), 0
        try:
            for unit, encoded in self._encoded(state["next_unit"]):
                pending_closed += self._consume(unit, encoded, state, writers)
                state["next_unit"] = unit.index + 1
                if pending_closed or time.monotonic() - last_save > _CHECKPOINT_SECONDS:
                    self._checkpoint(state, writers)
                    last_save, pending_closed = time.monotonic(), 0
            for split, writer in writers.items():
                state["writers"][split] = {**writer.state(), "split": split}
                state["writers"][split]["shards"] = writer.finish()
        except PrepareError:
            for writer in writers.values():
                writer.close()
            shutil.rmtree(self.partial, ignore_errors=True)  # bad input: nothing to resume
            raise
        finally:
            for writer in writers.values():
                writer.close()

    def _checkpoint(self, state: JSON, writers: dict[str, ShardWriter]) -> None:
        for split, writer in writers.items():
            writer.sync()
            state["writers"][split] = {**writer.state(), "split": split}
        _write_json(self.partial / "progress.json", state)

    def _encoded(self, start: int) -> Iterator[tuple[Unit, Encoded]]:
        """``(unit, tokens)`` in input order, from unit ``start`` on; work goes out in jobs of
        at most ``unit_bytes`` (several small files per job), at most ``2 * workers`` at once."""
        every = iter_units(self.sources, self.unit_bytes, self.field)
        units = (u for u in every if u.index >= start)
        tokenizer_json = None if self.tokenizer.spec == "bytes" else self.tokenizer.to_str()
        init = (tokenizer_json, self.tokenizer.eos_id, self.workers > 1)

        def jobs() -> Iterator[list[Unit]]:
            batch: list[Unit] = []
            size = 0
            for unit in units:  # never more than unit_bytes per job: that bounds the memory
                if batch and size + len(unit.data) > self.unit_bytes:
                    yield batch
                    batch, size = [], 0
                batch.append(unit)
                size += len(unit.data)
            if batch:
                yield batch

        def payload(batch: list[Unit]) -> list[tuple[str, bytes, bool]]:
            return [(self.sources[u.source].kind, u.data, u.last) for u in batch]

        if self.workers == 1:
            init_worker(tokenizer_json, self.tokenizer.eos_id, False)
            for batch in jobs():
                yield from zip(
                    batch, encode_units(payload(batch), self.field, self.strict), strict=True
                )
            return
        # fork is fast and needs no importable __main__; a process that imported torch holds
        # native threads, and forking it is unsafe, so it spawns fresh interpreters instead.
        fork = os.name == "posix" and "torch" not in sys.modules
        context = multiprocessing.get_context("fork" if fork else "spawn")
        pool = ProcessPoolExecutor(
            self.workers, mp_context=context, initializer=init_worker, initargs=init
        )
        pending: deque = deque()
        try:
            for batch in jobs():
                future = pool.submit(encode_units, payload(batch), self.field, self.strict)
                pending.append((batch, future))
                if len(pending) >= 2 * self.workers:
                    done, future = pending.popleft()
                    yield from zip(done, future.result(), strict=True)
            while pending:
                done, future = pending.popleft()
                yield from zip(done, future.result(), strict=True)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _consume(
        self, unit: Unit, encoded: Encoded, state: JSON, writers: dict[str, ShardWriter]
    ) -> int:
        """Write one unit's tokens to the train/eval shards; returns the shards it closed."""
        source = self.sources[unit.source]
        if encoded.error is not None:
            where, message = encoded.error
            if source.kind == "jsonl":
                raise PrepareError(f"{source.path}:{unit.first_line + where}: {message}")
            if source.kind == "parquet":
                raise PrepareError(
                    f"{source.path}: row {unit.rows[where] + 1}, column {self.field!r}: {message} "
                    "(--utf8 strict); fix the file or use --utf8 replace"
                )
            raise PrepareError(
                f"{source.path}: {message} at byte {unit.offset + where} (--utf8 strict); fix "
                "the file or use --utf8 replace"
            )
        held = self._held_out(sum(state["documents"].values()), len(encoded.lengths))
        if held.all() or not held.any():
            parts = {"eval" if held.any() else "train": encoded.tokens}
        else:
            mask = np.repeat(held, encoded.lengths)
            parts = {"train": encoded.tokens[~mask], "eval": encoded.tokens[mask]}
        closed = 0
        for split, tokens in parts.items():
            closed += writers[split].write(tokens)
            state["tokens"][split] += int(tokens.size)
        # A JSONL or Parquet piece is a whole record; a text piece ends its document with
        # the file.
        ended = held if source.kind != "text" else held[: int(unit.last)]
        state["documents"]["eval"] += int(ended.sum())
        state["documents"]["train"] += int(ended.size - ended.sum())
        stats = state["sources"][unit.source]
        stats[0] += int(ended.size)
        stats[1] += int(encoded.tokens.size)
        stats[2] += encoded.replaced
        state["bytes"] += unit.span
        if unit.last and stats[2]:
            self.log(f"{source.path}: {stats[2]} invalid UTF-8 sequences replaced with U+FFFD")
        if self.progress is not None:
            self.progress(unit.span, int(encoded.tokens.size))
        return closed

    def _held_out(self, first: int, count: int) -> np.ndarray:
        """Which of documents ``first .. first + count - 1`` are held out (see the module)."""
        index = np.arange(first, first + count, dtype=np.int64)
        num, den = self.holdout.numerator, self.holdout.denominator
        return (index + 1) * num // den > index * num // den

    # ------------------------------------------------------------------ finish
    def _finalize(self, state: JSON) -> JSON:
        meta = state.get("meta") or self._meta(state)
        if not state.get("finalizing"):
            state.update(finalizing=True, meta=meta)
            _write_json(self.partial / "progress.json", state)
        old = _read_json(self.output / META)
        (self.output / META).unlink(missing_ok=True)
        fsync_dir(self.output)
        keep = {e["file"] for split in meta["shards"].values() for e in split}
        for path in self.output.iterdir():
            if _SHARD_FILE.match(path.name) and path.name not in keep:
                path.unlink()
        for name in sorted(keep):
            if (self.partial / name).exists():
                os.replace(self.partial / name, self.output / name)
        fsync_dir(self.output)
        _write_json(self.output / META, meta)
        shutil.rmtree(self.partial, ignore_errors=True)
        if old is not None and old.get("fingerprint") != self.fingerprint:
            self.log(f"replaced the previous corpus in {self.output} (--overwrite)")
        return meta

    def _meta(self, state: JSON) -> JSON:
        tokens, documents = state["tokens"], state["documents"]
        if tokens["train"] == 0:
            raise PrepareError("the inputs hold no text to tokenize (every document is empty)")
        if self.holdout and documents["eval"] == 0:
            raise PrepareError(
                f"--holdout {float(self.holdout):g} of {documents['train']} documents holds out "
                "none (each text file, JSONL record and Parquet row is one document); use more "
                "documents or a larger --holdout"
            )
        from speedtronic import __version__

        return {
            "format": FORMAT,
            "version": 1,
            "fingerprint": self.fingerprint,
            "tokenizer": {
                "spec": self.tokenizer.spec,
                "file": str(self.tokenizer.info.path.resolve()) if self.vocab_file else None,
                "sha256": self.tokenizer.sha256,
                "encoding": self.tokenizer.encoding,
                "vocab_size": self.vocab,
                "eos_id": self.tokenizer.eos_id,
                "eos_token": self.tokenizer.eos_token,
            },
            "dtype": self.dtype,
            "shard_tokens": self.shard_tokens,
            "documents": dict(documents),
            "tokens": dict(tokens),
            "shards": {s: state["writers"][s]["shards"] for s in ("train", "eval")},
            "holdout": {
                "fraction": float(self.holdout),
                "rule": "document i (from 0) is held out when floor((i+1)*f) > floor(i*f)",
            },
            "field": self.field,
            "sources": [
                {
                    "path": s.path,
                    "kind": s.kind,
                    "bytes": s.size,
                    "documents": d,
                    "tokens": t,
                    "replaced": r,
                }
                for s, (d, t, r) in zip(self.sources, state["sources"], strict=True)
            ],
            "skipped_empty_files": self.skipped,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "speedtronic": __version__,
        }


def prepare(
    inputs: Sequence[str],
    output: str | os.PathLike[str],
    *,
    tokenizer: str = "bytes",
    field: str = "text",
    holdout: float | str = 0.0,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    unit_bytes: int = DEFAULT_UNIT_BYTES,
    utf8: str = "replace",
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> PrepareResult:
    """Tokenize ``inputs`` into ``output`` (see the module docstring); returns what it did.

    ``log(message)`` receives plain notes (resume, start clean, replaced bytes);
    ``progress(bytes, tokens)`` is called after each unit; ``on_start(total_bytes)`` once before
    the first unit. ``utf8``: ``replace`` (count and replace invalid bytes) or ``strict``.
    """
    if utf8 not in ("replace", "strict"):
        raise PrepareError(f"--utf8 must be replace or strict, got {utf8!r}")
    options = dict(log=log, progress=progress, workers=workers, shard_tokens=shard_tokens)
    options.update(unit_bytes=unit_bytes, field=field, utf8=utf8, holdout=holdout)
    return _Run(inputs, output, tokenizer=tokenizer, **options).run(overwrite, on_start)
