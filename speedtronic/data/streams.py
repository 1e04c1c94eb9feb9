"""Per-node training streams: what DumbDiLoCo node ``X`` trains on, reproducible anywhere.

Nodes that shared ``data.seed`` would draw identical batches and contribute identical
pseudo-gradients. Each node therefore draws its training stream (shuffled order, random
windows, synthetic training samples) from a **stream seed** that mixes the node id into
``data.seed`` with a stable hash (CRC-32), while ``data.seed`` itself keeps fixing everything
that must be identical on every node: the Markov chain of ``data.synthetic: markov`` and every
held-out set. The stream is deterministic per node, so resume stays exact.

``build_node_dataloader(config, node_id)`` builds exactly the loader the runtime builds for
node ``node_id`` (``None``: a run without DiLoCo), so an in-process simulation of K nodes can
reproduce the real processes' data.
"""

from __future__ import annotations

import zlib

from speedtronic.config import SpeedtronicConfig
from speedtronic.config.tokenizer_file import is_bytes
from speedtronic.data.loader import ResumableDataLoader, build_dataloader
from speedtronic.data.tokenizer import TokenizerLike, tokenizer_for

__all__ = ["build_node_dataloader", "node_stream_seed"]


def node_stream_seed(seed: int | None, node_id: str | None) -> int:
    """The training-stream seed of ``node_id`` (``seed`` itself when ``node_id`` is None)."""
    base = int(seed if seed is not None else 0)
    if node_id is None:
        return base
    return (base + zlib.crc32(str(node_id).encode("utf-8"))) % 2**31


def build_node_dataloader(
    config: SpeedtronicConfig,
    node_id: str | None = None,
    *,
    pin_memory_device: bool = False,
    tokenizer: TokenizerLike | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> ResumableDataLoader:
    """The training loader of ``node_id`` for a ``SpeedtronicConfig`` (see the module docstring).

    Uses ``config.data`` (``data.tokenizer`` unless ``tokenizer`` is given),
    ``config.model.vocab_size`` and ``config.eval.holdout`` (the held-out end of the source is
    never trained on). ``rank``/``world_size``: the shard of one of the node's data-parallel
    ranks (disjoint batches of the node's one stream).
    """
    data = config.data
    if tokenizer is None and not is_bytes(data.tokenizer):
        tokenizer = tokenizer_for(config)  # with the Hub token, for a private tokenizer repo
    return build_dataloader(
        data,
        pin_memory_device=pin_memory_device,
        vocab_size=config.model.vocab_size,
        tokenizer=tokenizer,
        stream_seed=node_stream_seed(data.seed, node_id),
        holdout=config.eval.holdout,
        rank=rank,
        world_size=world_size,
    )
