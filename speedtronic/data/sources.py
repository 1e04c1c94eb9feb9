"""Open the data source named by a ``data`` config section and check it before training.

Every problem is a ``ConfigError`` naming the setting and the fix, raised while the loader
is built (never halfway through a run). Precedence: ``text_path`` > ``token_path`` >
``dataset`` > synthetic (``markov`` or ``uniform``).

``holdout`` (``eval.holdout``) removes the last fraction of the source from training: the last
bytes of a text file, the last tokens of a token file or 1-D token tensor, the last samples of
a map-style dataset. Synthetic sources are unchanged (their held-out samples come from another
seed domain, see :mod:`speedtronic.data.heldout`). ``stream_seed`` seeds the synthetic
training samples (the sampler seed is set by the loader).
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset

from speedtronic.config import DataConfig
from speedtronic.data.datasets import (
    SampleTensorDataset,
    SyntheticTokenDataset,
    TextFileTokenDataset,
    TokenFileDataset,
    TokenWindowDataset,
)
from speedtronic.data.markov import MarkovTokenDataset
from speedtronic.data.shards import TokenArray
from speedtronic.data.tokenizer import Tokenizer, TokenizerLike

__all__ = [
    "check_token_ids",
    "configured_tokenizer",
    "open_source",
    "read_tokens",
    "split_map_dataset",
    "split_point",
    "token_array",
    "tokenizer_marks",
]

TOKEN_DTYPES = ("uint16", "uint32")
# Vocabulary check: this many evenly spaced blocks of this many tokens are read.
_SAMPLE_BLOCKS = 64
_SAMPLE_BLOCK_TOKENS = 4096


def _error(message: str) -> Exception:
    from speedtronic.config import ConfigError

    return ConfigError(message)


def split_point(total: int, holdout: float) -> int:
    """How many of ``total`` items (bytes, tokens, samples) training keeps under ``holdout``."""
    return int(total * (1.0 - float(holdout)))


def open_source(
    config: DataConfig,
    *,
    block_size: int,
    vocab_size: int,
    tokenizer: TokenizerLike | None = None,
    holdout: float = 0.0,
    stream_seed: int | None = None,
) -> Dataset:
    """Return the training dataset the ``data`` section asks for (validated; see above)."""
    seed = config.seed or 0
    samples_seed = seed if stream_seed is None else stream_seed
    text_path = config.text_path
    if text_path:
        if tokenizer is None:
            tokenizer = configured_tokenizer(config, vocab_size)
        return _open_text(os.fspath(text_path), block_size, vocab_size, tokenizer, holdout)
    token_path = config.token_path
    if token_path:
        return _open_token_file(config, block_size, vocab_size, holdout, tokenizer)
    spec = config.dataset
    if isinstance(spec, (Dataset, IterableDataset)):
        return split_map_dataset(spec, holdout, "data.dataset", block_size)[0]
    if spec is not None:
        dataset = _open_serialized(os.fspath(spec), config.allow_pickle, block_size, vocab_size)
        return split_map_dataset(dataset, holdout, "data.dataset", block_size)[0]
    kind = config.synthetic
    if kind == "none":
        raise _error(
            "data.synthetic: false but no data source is set; "
            "set data.text_path, data.token_path or data.dataset"
        )
    num_samples = config.num_tokens
    if kind == "uniform":
        return SyntheticTokenDataset(num_samples, block_size, vocab_size, seed=samples_seed)
    return MarkovTokenDataset(num_samples, block_size, vocab_size, seed, sample_seed=samples_seed)


def configured_tokenizer(config: DataConfig, vocab_size: int) -> Tokenizer | None:
    """The tokenizer ``data.tokenizer`` names (``None`` for the default byte tokenizer)."""
    from speedtronic.config.tokenizer_file import is_bytes
    from speedtronic.data.tokenizer import load_tokenizer

    spec = config.tokenizer
    return None if is_bytes(spec) else load_tokenizer(spec, vocab_size=vocab_size)


def tokenizer_marks(
    config: DataConfig, tokenizer: TokenizerLike | None = None
) -> tuple[str, ...] | None:
    """What identifies the tokenizer in use, to match a prepared folder's ``meta.json``: the
    file's sha256 and the digest of what it encodes (``("bytes",)`` for bytes), so a copy that
    encodes the same ids (an exported model's ``tokenizer.json``) matches too.

    ``None`` (no check) for a tokenizer object passed from Python without a hash.
    """
    if tokenizer is not None:
        marks = (getattr(tokenizer, "sha256", None), getattr(tokenizer, "encoding", None))
        found = tuple(mark for mark in marks if isinstance(mark, str) and mark)
        return found or None
    from speedtronic.config.tokenizer_file import describe_tokenizer, is_bytes

    spec = config.tokenizer
    if is_bytes(spec):
        return ("bytes",)
    info = describe_tokenizer(str(spec))
    return info.sha256, info.encoding


def split_map_dataset(
    dataset: Dataset, holdout: float, field: str, block_size: int
) -> tuple[Dataset, Dataset | TokenArray | None]:
    """``(training part, held-out part)`` of a dataset: its last ``holdout`` fraction held out.

    Token streams (``TokenWindowDataset``) are split by tokens, anything else with ``len()`` by
    samples. The held-out part is ``None`` when ``holdout`` is 0. Iterable datasets cannot be
    split (``ConfigError`` naming ``eval.holdout``).
    """
    if holdout <= 0:
        return dataset, None
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise _error(
            f"eval.holdout: {field} is an iterable (streaming) dataset without len(); its end "
            "cannot be held out. Use a map-style dataset, name a held-out file with "
            "eval.text_path / eval.token_path, or set eval.holdout: 0"
        )
    if isinstance(dataset, TokenWindowDataset):
        tokens = dataset.tokens
        cut = split_point(len(tokens), holdout)
        if cut <= block_size:
            raise _too_short(field, "(training part)", cut, block_size, holdout)
        return TokenWindowDataset(tokens[:cut], block_size), tokens[cut:]
    total = len(dataset)
    cut = split_point(total, holdout)
    if cut <= 0 or cut >= total:
        raise _error(
            f"eval.holdout: {holdout} of the {total} samples of {field} leaves "
            f"{cut} for training and {total - cut} held out; both need at least one"
        )
    if isinstance(dataset, SampleTensorDataset):
        training = SampleTensorDataset(dataset.inputs[:cut], dataset.labels[:cut])
        held = SampleTensorDataset(dataset.inputs[cut:], dataset.labels[cut:])
        return training, held
    return Subset(dataset, range(cut)), Subset(dataset, range(cut, total))


def _require_file(field: str, path: str) -> None:
    if not os.path.exists(path):
        raise _error(f"{field}: file not found: {path}")
    if not os.path.isfile(path):
        raise _error(f"{field}: not a regular file: {path}")
    if os.path.getsize(path) == 0:
        raise _error(f"{field}: file is empty: {path}")


def _too_short(
    field: str, path: str, have: int, block_size: int, holdout: float = 0.0
) -> Exception:
    kept = f" (after eval.holdout: {holdout} keeps the end for evaluation)" if holdout else ""
    return _error(
        f"data.block_size: {block_size} is larger than the data: {field} {path} holds "
        f"{have} tokens{kept}, at least {block_size + 1} are needed; lower data.block_size "
        "(model.max_seq_len) or use more data"
    )


def _open_text(
    path: str,
    block_size: int,
    vocab_size: int,
    tokenizer: TokenizerLike | None,
    holdout: float = 0.0,
) -> Dataset:
    _require_file("data.text_path", path)
    stop = split_point(os.path.getsize(path), holdout) if holdout > 0 else None
    dataset = TextFileTokenDataset(
        path, block_size, tokenizer=tokenizer, vocab_size=vocab_size, stop_byte=stop
    )
    have = 0
    for tokens in dataset.token_chunks():  # reads only a prefix: stops once one window fits
        have += tokens.numel()
        if have > block_size:
            break
    if have <= block_size:
        raise _too_short("data.text_path", path, have, block_size, holdout)
    if tokenizer is not None:
        first = next(dataset.token_chunks())
        check_token_ids(first, vocab_size, "data.text_path", path)
    return dataset


def _open_token_file(
    config: DataConfig,
    block_size: int,
    vocab_size: int,
    holdout: float,
    tokenizer: TokenizerLike | None,
) -> Dataset:
    path = os.fspath(config.token_path)
    tokens, dtype = read_tokens(config, path, vocab_size, "data.token_path", tokenizer=tokenizer)
    stop = split_point(len(tokens), holdout) if holdout > 0 else None
    kept = len(tokens) if stop is None else stop
    if kept <= block_size:
        raise _too_short("data.token_path", path, kept, block_size, holdout)
    return TokenFileDataset(path, block_size, dtype=dtype, stop=stop)


def read_tokens(
    config: DataConfig,
    path: str | os.PathLike[str],
    vocab_size: int,
    field: str,
    *,
    tokenizer: TokenizerLike | None = None,
    split: str = "train",
) -> tuple[TokenArray, str]:
    """:func:`token_array` of ``path`` read with ``config.token_dtype``; a folder written by
    ``speedtronic prepare`` must come from the tokenizer in use (``tokenizer``, default: the one
    ``config.tokenizer`` names)."""
    path = os.fspath(path)
    marks = tokenizer_marks(config, tokenizer) if os.path.isdir(path) else None
    return token_array(
        path, config.token_dtype, vocab_size, field, split=split, tokenizer_marks=marks
    )


def token_array(
    path: str,
    dtype: str,
    vocab_size: int,
    field: str,
    *,
    split: str = "train",
    tokenizer_marks: Sequence[str] | None = None,
) -> tuple[TokenArray, str]:
    """Open and check a token file (``field`` names the setting in errors); ``(array, dtype)``.

    ``.npy`` files carry their own dtype; ``.bin`` files use ``dtype`` (``data.token_dtype``).
    A folder written by ``speedtronic prepare`` gives the shards of ``split`` (dtype from its
    ``meta.json``; refused when made with another tokenizer than ``tokenizer_marks`` names,
    see :func:`tokenizer_marks`). Token ids are checked against ``vocab_size`` on a bounded
    sample.
    """
    if os.path.isdir(path):
        from speedtronic.data.shards import open_prepared

        tokens = open_prepared(
            path, split, field, vocab_size=vocab_size, tokenizer_marks=tokenizer_marks
        )
        check_token_ids(_sample(tokens), vocab_size, field, path)
        return tokens, tokens.dtype.name
    _require_file(field, path)
    if dtype not in TOKEN_DTYPES:
        raise _error(f"data.token_dtype: must be uint16 or uint32, got {dtype!r}")
    if path.endswith(".npy"):
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as exc:
            raise _error(f"{field}: {path} is not a readable .npy file: {exc}") from exc
        if tokens.dtype.name not in TOKEN_DTYPES:
            raise _error(
                f"{field}: {path} holds {tokens.dtype.name} values; token files must "
                "be uint16 or uint32 (save with arr.astype(np.uint16) or np.uint32)"
            )
        if tokens.ndim != 1:
            raise _error(
                f"{field}: {path} has shape {tokens.shape}; a token file must be "
                "one flat 1-D stream (use arr.reshape(-1))"
            )
        dtype = tokens.dtype.name
    elif path.endswith(".bin"):
        size = os.path.getsize(path)
        itemsize = np.dtype(dtype).itemsize
        if size % itemsize:
            raise _error(
                f"{field}: {path} is {size} bytes, not a multiple of {itemsize}; it "
                f"cannot hold {dtype} tokens (check data.token_dtype)"
            )
        tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    else:
        raise _error(f"{field}: {path} must end in .bin (raw tokens, data.token_dtype) or .npy")
    check_token_ids(_sample(tokens), vocab_size, field, path, dtype)
    return tokens, dtype


def _sample(tokens: TokenArray) -> np.ndarray:
    """A bounded sample of a long token stream: evenly spaced blocks (whole stream if small)."""
    n = len(tokens)
    if n <= _SAMPLE_BLOCKS * _SAMPLE_BLOCK_TOKENS:
        return np.asarray(tokens)
    starts = np.linspace(0, n - _SAMPLE_BLOCK_TOKENS, _SAMPLE_BLOCKS).astype(np.int64)
    return np.concatenate([np.asarray(tokens[s : s + _SAMPLE_BLOCK_TOKENS]) for s in starts])


def check_token_ids(
    sample: np.ndarray | torch.Tensor,
    vocab_size: int,
    field: str,
    path: str,
    dtype: str | None = None,
) -> None:
    """Raise ``ConfigError`` when a token id in ``sample`` is >= ``vocab_size`` or negative."""
    values = sample.numpy() if isinstance(sample, torch.Tensor) else np.asarray(sample)
    if values.size == 0:
        return
    high, low = int(values.max()), int(values.min())
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        hint = f" or data.token_dtype ({dtype}) is wrong" if dtype else ""
        raise _error(
            f"{field}: {path} contains token id {bad}, outside the model vocabulary "
            f"[0, {vocab_size}) (model.vocab_size); the data was tokenized for another "
            f"vocabulary{hint}"
        )


def _open_serialized(path: str, allow_pickle: bool, block_size: int, vocab_size: int) -> Dataset:
    _require_file("data.dataset", path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not zipfile.is_zipfile(path):
            raise _error(f"data.dataset: cannot load {path}: not a torch.save file") from exc
        if not allow_pickle:
            raise _error(
                f"data.dataset: {path} contains pickled Python objects, and unpickling can "
                "run arbitrary code; set data.allow_pickle: true only if you trust this file"
            ) from exc
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as inner:
            raise _error(f"data.dataset: cannot load {path}: {inner}") from inner
    except Exception as exc:
        raise _error(f"data.dataset: cannot load {path}: {exc}") from exc
    if isinstance(obj, (Dataset, IterableDataset)):
        return obj
    return _dataset_from_tensors(obj, path, block_size, vocab_size)


def _dataset_from_tensors(obj: object, path: str, block_size: int, vocab_size: int) -> Dataset:
    expected = (
        "expected a 1-D token tensor, a 2-D (samples, block_size + 1) tensor, a dict with "
        "'input_ids' and 'labels' tensors, or (with data.allow_pickle: true) a Dataset"
    )
    if isinstance(obj, dict) and {"input_ids", "labels"} <= set(obj):
        inputs, labels = obj["input_ids"], obj["labels"]
        if not (isinstance(inputs, torch.Tensor) and isinstance(labels, torch.Tensor)):
            raise _error(f"data.dataset: {path}: input_ids and labels must be tensors")
        if inputs.ndim != 2 or inputs.shape != labels.shape:
            raise _error(
                f"data.dataset: {path}: input_ids and labels must be (samples, sequence) "
                f"tensors of one shape, got {tuple(inputs.shape)} and {tuple(labels.shape)}"
            )
        if inputs.shape[1] < block_size:
            raise _error(
                f"data.block_size: {block_size} is larger than the data: data.dataset {path} "
                f"holds samples of {inputs.shape[1]} tokens; lower data.block_size"
            )
        check_token_ids(inputs, vocab_size, "data.dataset", path)
        valid = labels[labels != -100]
        check_token_ids(valid, vocab_size, "data.dataset", path)
        return SampleTensorDataset(inputs[:, :block_size], labels[:, :block_size])
    if not isinstance(obj, torch.Tensor):
        raise _error(f"data.dataset: {path} holds a {type(obj).__name__}; {expected}")
    if obj.dtype.is_floating_point or obj.dtype == torch.bool or obj.ndim not in (1, 2):
        raise _error(
            f"data.dataset: {path} holds a {obj.dtype} tensor of shape {tuple(obj.shape)}; "
            f"{expected}"
        )
    check_token_ids(obj, vocab_size, "data.dataset", path)
    if obj.ndim == 1:
        if obj.numel() <= block_size:
            raise _too_short("data.dataset", path, obj.numel(), block_size)
        return TokenWindowDataset(obj.to(torch.long), block_size)
    if obj.shape[1] <= block_size:
        raise _too_short("data.dataset", path, obj.shape[1], block_size)
    rows = obj[:, : block_size + 1].to(torch.long)
    return SampleTensorDataset(rows[:, :-1], rows[:, 1:])
