"""Training data (``speedtronic.data``): datasets, tokenizer and the resumable loader.

Sources, chosen by the ``data`` config section (first match): ``text_path`` (UTF-8 text,
streamed with the byte-level ``CharTokenizer``), ``token_path`` (``.bin``/``.npy`` uint16 or
uint32 tokens, memory-mapped, ``sampling: random|sequential`` windows), ``dataset`` (a
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
"""

from speedtronic.data.datasets import (
    SampleTensorDataset,
    SyntheticTokenDataset,
    TextFileTokenDataset,
    TokenFileDataset,
    TokenWindowDataset,
)
from speedtronic.data.heldout import HeldOutSource, open_heldout
from speedtronic.data.loader import (
    EpochSampler,
    ResumableDataLoader,
    TokenWindowSampler,
    build_dataloader,
    collate_batch,
    collate_causal,
    data_state_dict,
    infinite_batches,
    load_data_state_dict,
)
from speedtronic.data.markov import MarkovChain, MarkovTokenDataset
from speedtronic.data.streams import build_node_dataloader, node_stream_seed
from speedtronic.data.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "EpochSampler",
    "HeldOutSource",
    "MarkovChain",
    "MarkovTokenDataset",
    "ResumableDataLoader",
    "SampleTensorDataset",
    "SyntheticTokenDataset",
    "TextFileTokenDataset",
    "TokenFileDataset",
    "TokenWindowDataset",
    "TokenWindowSampler",
    "build_dataloader",
    "build_node_dataloader",
    "collate_batch",
    "collate_causal",
    "data_state_dict",
    "infinite_batches",
    "load_data_state_dict",
    "node_stream_seed",
    "open_heldout",
]
