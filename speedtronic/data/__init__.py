"""Training data (``speedtronic.data``): datasets, tokenizer and the resumable loader.

Sources, chosen by the ``data`` config section (first match): ``text_path`` (UTF-8 text,
streamed with the tokenizer ``data.tokenizer`` names: the byte-level ``CharTokenizer`` by
default, or a Hugging Face ``tokenizer.json``), ``token_path`` (``.bin``/``.npy`` uint16 or
uint32 tokens, or a folder written by ``speedtronic prepare``, memory-mapped,
``sampling: random|sequential`` windows), ``dataset`` (a
``torch.save``d tensor/dict, or a pickled ``Dataset`` with ``allow_pickle: true``), else
deterministic synthetic tokens: ``synthetic: markov`` (a learnable seeded Markov chain whose
entropy rate is the loss floor, ``MarkovTokenDataset.floor``) or ``uniform`` (random tokens).
Bad input raises ``ConfigError`` from ``build_dataloader``.

``eval.holdout`` keeps the end of the source out of training; ``open_heldout`` reads that
region (or ``eval.text_path``/``eval.token_path``) for evaluation. DiLoCo nodes train on their
own stream (``node_stream_seed``, ``build_node_dataloader``) while the chain and the held-out
data stay identical on every node.

Batches are ``(inputs, labels)`` tuples of int64 ``(B, T)`` (``labels`` already shifted).

Exact resume (for the trainer)::

    loader = build_dataloader(config.data, vocab_size=config.model.vocab_size,
                              pin_memory_device=device.type == "cuda")
    # saving a checkpoint, after the step's K micro-batches were drawn:
    state["data"] = data_state_dict(loader)   # small dict of ints, or None for foreign loaders
    # resuming, after building the loader and BEFORE the first batch is drawn:
    load_data_state_dict(loader, state.get("data"))   # no-op for None / foreign loaders
    batches = infinite_batches(loader)

The position counts batches handed to the consumer (not batches prefetched by workers), so
it is exact with any ``num_workers``; restored exactly at the end of an epoch, the next
pass starts the next epoch (never an empty pass). ``ResumableDataLoader.state_dict()`` /
``load_state_dict()`` are the same thing as methods. Shuffled orders and random windows come
from private generators seeded by ``(data.seed, epoch)``, never the global RNG.

Names and submodules load on first use, so ``speedtronic.data.prepare``, ``shards`` and
``tokenizer`` run without importing torch (``speedtronic prepare`` starts fast and stays small).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SampleTensorDataset": "datasets",
    "SyntheticTokenDataset": "datasets",
    "TextFileTokenDataset": "datasets",
    "TokenFileDataset": "datasets",
    "TokenWindowDataset": "datasets",
    "HeldOutSource": "heldout",
    "open_heldout": "heldout",
    "EpochSampler": "loader",
    "ResumableDataLoader": "loader",
    "TokenWindowSampler": "loader",
    "build_dataloader": "loader",
    "collate_batch": "loader",
    "collate_causal": "loader",
    "data_state_dict": "loader",
    "infinite_batches": "loader",
    "load_data_state_dict": "loader",
    "MarkovChain": "markov",
    "MarkovTokenDataset": "markov",
    "TokenShards": "shards",
    "open_prepared": "shards",
    "build_node_dataloader": "streams",
    "node_stream_seed": "streams",
    "CharTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tokenizer_for": "tokenizer",
}

__all__ = sorted(_EXPORTS)


_SUBMODULES = frozenset(
    {
        "datasets",
        "heldout",
        "loader",
        "markov",
        "prepare",
        "shards",
        "sources",
        "streams",
        "tokenizer",
        "units",
    }
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"speedtronic.data.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'speedtronic.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"speedtronic.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
