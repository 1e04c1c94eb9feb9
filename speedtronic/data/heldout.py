"""Held-out records for evaluation: the region of data that training never reads.

``open_heldout(data, evaluation, ...)`` returns the records of the held-out region in a fixed
order from its start (or ``None`` when the ``eval`` section names no held-out source):

* ``eval.text_path`` / ``eval.token_path`` (``.bin`` read with ``data.token_dtype``): the whole
  file, as sequential non-overlapping windows of ``block_size + 1`` tokens;
* ``eval.holdout`` over ``data.text_path``: the last ``holdout`` fraction of the file's bytes,
  as sequential windows; over ``data.token_path``: the last fraction of its tokens, likewise;
* ``eval.holdout`` over ``data.dataset``: its last samples in order (a 1-D token tensor: its
  last tokens, as sequential windows);
* ``eval.holdout`` over ``synthetic: markov`` / ``uniform``: ``ceil(holdout * num_tokens)``
  samples of the held-out seed domain, ``0, 1, ...``.

Everything here depends on ``data.seed`` (never on the node's stream seed), so every DiLoCo
node and the master hold out, and score, exactly the same tokens. Errors are ``ConfigError``s
naming the field (a held-out file that is missing or shorter than one window, ...).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from speedtronic.config import DataConfig, EvalConfig
from speedtronic.data.datasets import TextFileTokenDataset
from speedtronic.data.markov import HELDOUT_DOMAIN, MarkovTokenDataset, seed_generator
from speedtronic.data.shards import TokenArray
from speedtronic.data.sources import (
    _error,
    _require_file,
    configured_tokenizer,
    open_dataset,
    read_tokens,
    split_map_dataset,
    split_point,
)
from speedtronic.data.tokenizer import TokenizerLike

__all__ = ["HeldOutSource", "open_heldout"]

Record = dict[str, torch.Tensor]


@dataclass
class HeldOutSource:
    """The held-out region: ``records()`` yields it from the start, in a fixed order.

    ``description`` says where it comes from (for logs); ``floor`` is the lowest reachable
    mean cross-entropy in nats when known (the Markov chain's entropy rate), else ``None``.
    """

    records: Callable[[], Iterator[Record]]
    description: str
    floor: float | None = None


def _windows(tokens: TokenArray, block_size: int) -> Iterator[Record]:
    """Sequential non-overlapping windows of ``block_size + 1`` from a 1-D token array."""
    span = block_size + 1
    for start in range(0, len(tokens) - block_size, span):
        window = np.asarray(tokens[start : start + span], dtype=np.int64)
        tensor = torch.from_numpy(window.copy())
        yield {"input_ids": tensor[:-1], "labels": tensor[1:]}


def _text_records(
    path: str,
    block_size: int,
    vocab_size: int,
    start_byte: int,
    field: str,
    tokenizer: TokenizerLike | None,
) -> Callable[[], Iterator[Record]]:
    dataset = TextFileTokenDataset(
        path, block_size, tokenizer=tokenizer, vocab_size=vocab_size, start_byte=start_byte
    )
    if next(iter(dataset), None) is None:
        raise _error(
            f"{field}: the held-out text ({path} from byte {start_byte}) is shorter than one "
            f"window of data.block_size + 1 = {block_size + 1} tokens; use more held-out text "
            "or a smaller block size"
        )
    return dataset.__iter__


def _token_records(
    tokens: TokenArray, block_size: int, what: str, field: str
) -> Callable[[], Iterator[Record]]:
    if len(tokens) <= block_size:
        raise _error(
            f"{field}: the held-out tokens ({what}) number {len(tokens)}, fewer than one window "
            f"of data.block_size + 1 = {block_size + 1}; use more held-out data"
        )
    return lambda: _windows(tokens, block_size)


def _uniform_records(
    count: int, block_size: int, vocab_size: int, seed: int
) -> Callable[[], Iterator[Record]]:
    def records() -> Iterator[Record]:
        for index in range(count):
            rng = seed_generator(seed, HELDOUT_DOMAIN, index)
            window = torch.from_numpy(rng.integers(vocab_size, size=block_size + 1))
            yield {"input_ids": window[:-1], "labels": window[1:]}

    return records


def _held_samples(held: object) -> Callable[[], Iterator[Record]]:
    assert isinstance(held, Dataset) and isinstance(held, Sized)  # split_map_dataset checked
    return lambda: (held[index] for index in range(len(held)))


def open_heldout(
    data: DataConfig,
    evaluation: EvalConfig,
    *,
    block_size: int,
    vocab_size: int,
    tokenizer: TokenizerLike | None = None,
) -> HeldOutSource | None:
    """The held-out region named by ``evaluation`` (an ``EvalConfig``) over ``data``.

    Text is tokenized with ``tokenizer`` (default: the one ``data.tokenizer`` names). A folder
    written by ``speedtronic prepare`` as ``eval.token_path`` gives its held-out shards.
    """
    text_path = evaluation.text_path
    text_source = data.text_path if evaluation.holdout else None
    if tokenizer is None and (text_path or text_source):
        tokenizer = configured_tokenizer(data, vocab_size)
    if text_path:
        _require_file("eval.text_path", os.fspath(text_path))
        records = _text_records(
            os.fspath(text_path), block_size, vocab_size, 0, "eval.text_path", tokenizer
        )
        return HeldOutSource(records, f"eval.text_path {text_path}")
    token_path = evaluation.token_path
    if token_path:
        tokens, _ = read_tokens(
            data, token_path, vocab_size, "eval.token_path", tokenizer=tokenizer, split="eval"
        )
        records = _token_records(tokens, block_size, str(token_path), "eval.token_path")
        return HeldOutSource(records, f"eval.token_path {token_path}")
    holdout = evaluation.holdout
    if holdout <= 0:
        return None
    return _holdout_of_training(data, holdout, block_size, vocab_size, tokenizer)


def _holdout_of_training(
    data: DataConfig,
    holdout: float,
    block_size: int,
    vocab_size: int,
    tokenizer: TokenizerLike | None,
) -> HeldOutSource:
    share = f"last {holdout:g} of"
    text_path = data.text_path
    if text_path:
        path = os.fspath(text_path)
        start = split_point(os.path.getsize(path), holdout)
        records = _text_records(path, block_size, vocab_size, start, "eval.holdout", tokenizer)
        return HeldOutSource(records, f"{share} data.text_path {path}")
    token_path = data.token_path
    if token_path:
        tokens, _ = read_tokens(
            data, token_path, vocab_size, "data.token_path", tokenizer=tokenizer
        )
        tail = tokens[split_point(len(tokens), holdout) :]
        records = _token_records(tail, block_size, f"{share} {token_path}", "eval.holdout")
        return HeldOutSource(records, f"{share} data.token_path {token_path}")
    if data.dataset is not None:
        dataset = open_dataset(data, block_size, vocab_size)
        _, held = split_map_dataset(dataset, holdout, "data.dataset", block_size)
        if isinstance(held, (torch.Tensor, np.ndarray)):
            records = _token_records(held, block_size, f"{share} data.dataset", "eval.holdout")
        else:
            records = _held_samples(held)
        return HeldOutSource(records, f"{share} data.dataset")
    kind = data.synthetic
    if kind == "none":
        raise _error("eval.holdout: there is no training source to hold out (data.synthetic: none)")
    seed = data.seed or 0
    count = max(1, math.ceil(holdout * data.num_tokens))
    if kind == "uniform":
        records = _uniform_records(count, block_size, vocab_size, seed)
        return HeldOutSource(records, f"{count} held-out uniform samples (seed {seed})")
    held = MarkovTokenDataset(count, block_size, vocab_size, seed, domain=HELDOUT_DOMAIN)
    return HeldOutSource(
        _held_samples(held), f"{count} held-out Markov samples (seed {seed})", held.floor
    )
