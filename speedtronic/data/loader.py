"""Batching: collate functions, resumable samplers and ``build_dataloader``.

Batches from the built-in loader are ``(inputs, labels)`` tuples of int64 ``(B, T)``
tensors. Only when records of different lengths meet in one batch (custom datasets) does
the collator pad and return ``{"input_ids", "labels", "attention_mask"}`` instead; without a
mask the reference model takes SDPA's ``is_causal`` fast path.

The loader is a ``DataLoader`` subclass that counts the batches it has handed out, so the
data position can be saved in a checkpoint and restored exactly (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from speedtronic.config import DataConfig, ModelConfig
from speedtronic.data.datasets import TextFileTokenDataset, TokenWindowDataset
from speedtronic.data.sources import open_source
from speedtronic.data.tokenizer import TokenizerLike
from speedtronic.json_types import StateDict

__all__ = [
    "EpochSampler",
    "ResumableDataLoader",
    "TokenWindowSampler",
    "build_dataloader",
    "collate_batch",
    "collate_causal",
    "data_state_dict",
    "infinite_batches",
    "load_data_state_dict",
]


_Batch = TypeVar("_Batch")


def collate_causal(
    batch: Sequence[dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
    """Stack causal-LM records into ``(inputs, labels)``, padding only when lengths differ.

    Equal lengths -> ``(input_ids, labels)`` int64 ``(B, T)``. Different lengths -> a dict
    with right-padded ``input_ids`` (pad 0), ``labels`` (pad -100) and a bool
    ``attention_mask`` (True over each record's tokens).
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    lengths = [int(item["input_ids"].numel()) for item in batch]
    if len(set(lengths)) == 1:
        inputs = torch.stack([item["input_ids"].reshape(-1) for item in batch]).long()
        labels = torch.stack([item["labels"].reshape(-1) for item in batch]).long()
        return inputs, labels
    size = max(lengths)
    inputs = torch.zeros(len(batch), size, dtype=torch.long)
    labels = torch.full((len(batch), size), -100, dtype=torch.long)
    mask = torch.zeros(len(batch), size, dtype=torch.bool)
    for row, (item, n) in enumerate(zip(batch, lengths, strict=True)):
        inputs[row, :n] = item["input_ids"].reshape(-1)
        labels[row, :n] = item["labels"].reshape(-1)[:n]
        mask[row, :n] = True
    return {"input_ids": inputs, "labels": labels, "attention_mask": mask}


def collate_batch(batch: Sequence[Any]) -> object:
    """Collate dict records (causal LM), tuples/lists (column-wise), tensors or anything else."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    first = batch[0]
    if isinstance(first, dict):
        return collate_causal(batch)
    if isinstance(first, (tuple, list)):
        if any(len(item) != len(first) for item in batch):
            raise ValueError("tuple dataset items must have the same number of fields")
        columns: list[torch.Tensor | list[object]] = []
        for column in zip(*batch, strict=True):
            if isinstance(column[0], torch.Tensor):
                if any(t.shape != column[0].shape for t in column):
                    raise ValueError("tensor dataset fields must have equal shapes")
                columns.append(torch.stack(list(column)))
            else:
                columns.append(list(column))
        return tuple(columns)
    if isinstance(first, torch.Tensor):
        return torch.stack(list(batch))
    return list(batch)


def infinite_batches(loader: Iterable[_Batch]) -> Iterator[_Batch]:
    """Loop over ``loader`` forever; a pass that yields nothing raises ``RuntimeError``."""
    while True:
        produced = False
        for batch in loader:
            produced = True
            yield batch
        if not produced:
            raise RuntimeError("data loader produced no batches")


_END = object()


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))


class EpochSampler(Sampler[int]):
    """Deterministic index order per ``(seed, epoch)``; can start mid-epoch.

    ``shuffle=False`` yields ``0..n-1``; ``shuffle=True`` a permutation drawn from a private
    generator (never the global RNG), so the order is reproducible on resume.

    ``shard(rank, world_size, block)`` makes it yield only the blocks of ``block`` consecutive
    positions of the order whose block number is ``rank`` modulo ``world_size``: the ranks of
    a node read disjoint windows, and together one micro-batch of each rank covers the same
    positions as one ``world_size`` times larger micro-batch of a single process.
    """

    def __init__(self, num_items: int, *, shuffle: bool = False, seed: int = 0) -> None:
        self.num_items = int(num_items)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.start = 0
        self.rank, self.world_size, self.block = 0, 1, 1

    def shard(self, rank: int, world_size: int, block: int) -> None:
        """Yield only rank ``rank``'s blocks of ``block`` positions (see the class docstring)."""
        self.rank, self.world_size, self.block = int(rank), int(world_size), max(1, int(block))

    def _mine(self, order: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return order
        blocks = torch.arange(order.numel()) // self.block
        return order[blocks % self.world_size == self.rank]

    def set_position(self, epoch: int, start: int) -> None:
        """Make the next iteration yield epoch ``epoch``'s order from position ``start``."""
        self.epoch, self.start = int(epoch), int(start)

    def order(self, epoch: int) -> torch.Tensor:
        """The full index order of ``epoch`` (int64 (n,))."""
        if self.shuffle:
            return torch.randperm(self.num_items, generator=_generator(self.seed, epoch))
        return torch.arange(self.num_items)

    def __iter__(self) -> Iterator[int]:
        return iter(self._mine(self.order(self.epoch))[self.start :].tolist())

    def __len__(self) -> int:
        if self.world_size == 1:
            return self.num_items
        return int(self._mine(torch.arange(self.num_items)).numel())


class TokenWindowSampler(EpochSampler):
    """Window starts for a ``TokenWindowDataset`` of ``num_tokens`` tokens.

    One epoch has ``(num_tokens - 1) // block_size`` windows. ``sequential``: starts
    ``0, B, 2B, ...`` (every next-token transition is a target once; shuffled order when
    ``shuffle``). ``random``: uniform random starts drawn per epoch from ``(seed, epoch)``.
    """

    def __init__(
        self,
        num_tokens: int,
        block_size: int,
        *,
        sampling: str = "random",
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if sampling not in ("random", "sequential"):
            raise ValueError(f"data.sampling must be 'random' or 'sequential', got {sampling!r}")
        super().__init__((int(num_tokens) - 1) // int(block_size), shuffle=shuffle, seed=seed)
        self.block_size = int(block_size)
        self.max_start = int(num_tokens) - int(block_size) - 1
        self.sampling = sampling

    def order(self, epoch: int) -> torch.Tensor:
        if self.sampling == "random":
            g = _generator(self.seed, epoch)
            return torch.randint(self.max_start + 1, (self.num_items,), generator=g)
        return super().order(epoch) * self.block_size


class ResumableDataLoader(DataLoader[object]):
    """A ``DataLoader`` whose position (epoch, batches handed out) can be saved and restored.

    Iterating continues from the current position; a completed pass advances the epoch.
    Map-style datasets restart mid-epoch through their ``EpochSampler`` without loading the
    skipped samples; iterable datasets are fast-forwarded by drawing and discarding batches.

    ``rank``/``world_size`` (a node's data-parallel ranks): this rank reads every
    ``world_size``-th batch of the node's stream, starting at batch ``rank`` (map-style
    datasets through the sampler's ``shard``, without loading the other ranks' samples). The
    saved position records ``ranks``, and a position saved with another rank count is
    converted through the node's global position (batches x batch size x ranks).
    """

    def __init__(
        self,
        dataset: Dataset[object],
        *args: Any,
        rank: int = 0,
        world_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._epoch = 0
        self._batches = 0  # batches handed out in the current epoch
        self.rank, self.world_size = int(rank), int(world_size)
        sampler = kwargs.get("sampler")
        self._epoch_sampler = sampler if isinstance(sampler, EpochSampler) else None
        if self._epoch_sampler is not None:
            self._epoch_sampler.shard(self.rank, self.world_size, int(self.batch_size or 1))

    def _rank_batches(self) -> Iterator[object]:
        batches = super().__iter__()
        if self.world_size == 1 or self._epoch_sampler is not None:
            return batches
        return (b for i, b in enumerate(batches) if i % self.world_size == self.rank)

    def __iter__(self) -> Iterator[object]:  # type: ignore[override]  # torch: a private class
        """One pass from the saved position (torch's stub names its private iterator class as
        ``__iter__``'s type; a pass here is a generator over the same batches)."""
        return self._pass()

    def _pass(self) -> Iterator[object]:
        start = self._batches
        skip = start
        if self._epoch_sampler is not None:
            self._epoch_sampler.set_position(self._epoch, start * int(self.batch_size or 1))
            skip = 0
        batches = self._rank_batches()
        for _ in range(skip):
            if next(batches, _END) is _END:
                break
        produced = False
        for batch in batches:
            produced = True
            self._batches += 1
            yield batch
        self._epoch += 1
        self._batches = 0
        if start > 0 and not produced:
            # Restored exactly at the end of an epoch: this pass continues with the next one.
            yield from self._pass()

    def state_dict(self) -> dict[str, int]:
        """Position to store in a checkpoint: ``{"epoch", "batches", "batch_size"}`` (and
        ``"ranks"`` when the node reads with several ranks)."""
        state = {
            "epoch": self._epoch,
            "batches": self._batches,
            "batch_size": int(self.batch_size or 1),
        }
        if self.world_size > 1:
            state["ranks"] = self.world_size
        return state

    def load_state_dict(self, state: StateDict) -> None:
        """Resume at a saved position; call before the next batch is drawn."""
        self._epoch = int(state.get("epoch", 0))
        batches = int(state.get("batches", 0))
        saved_batch = int(state.get("batch_size") or self.batch_size or 1)
        saved_ranks = int(state.get("ranks") or 1)
        own_batch = int(self.batch_size or 1)
        self._batches = batches * saved_batch * saved_ranks // (own_batch * self.world_size)


@runtime_checkable
class _SavesPosition(Protocol):
    def state_dict(self) -> Mapping[str, object]: ...


@runtime_checkable
class _LoadsPosition(Protocol):
    def load_state_dict(self, state: StateDict) -> None: ...


def data_state_dict(loader: object) -> StateDict | None:
    """The loader's data position, or ``None`` for a loader that cannot report one."""
    return dict(loader.state_dict()) if isinstance(loader, _SavesPosition) else None


def load_data_state_dict(loader: object, state: StateDict | None) -> bool:
    """Restore a position saved by ``data_state_dict``; False when nothing was restored."""
    if state is None or not isinstance(loader, _LoadsPosition):
        return False
    loader.load_state_dict(state)
    return True


def build_dataloader(
    config: DataConfig | None = None,
    *,
    dataset: Dataset[object] | None = None,
    tokenizer: TokenizerLike | None = None,
    pin_memory_device: bool = False,
    vocab_size: int | None = None,
    stream_seed: int | None = None,
    holdout: float = 0.0,
    rank: int = 0,
    world_size: int = 1,
) -> ResumableDataLoader:
    """Build the training loader from a ``data`` config section (``DataConfig``).

    Source: the ``dataset`` argument, else ``data.text_path`` > ``data.token_path`` >
    ``data.dataset`` > synthetic. ``vocab_size`` (the model's) wins over ``data.vocab_size``.
    ``stream_seed`` (default ``data.seed``) seeds the training stream: shuffled orders, random
    windows and synthetic training samples; ``data.seed`` keeps fixing the Markov chain (see
    :func:`speedtronic.data.streams.node_stream_seed` for DiLoCo nodes). ``holdout``
    (``eval.holdout``) keeps the last fraction of the source out of training. Bad input raises
    ``ConfigError`` naming the setting. Workers, prefetch, pinning, ``shuffle`` (ignored for
    iterable datasets) and ``drop_last`` follow the config. A bare section (not filled in by
    ``SpeedtronicConfig``) takes block and vocabulary sizes from the ``model`` defaults and
    seed 0. ``rank``/``world_size`` shard the stream between a node's data-parallel ranks
    (``ResumableDataLoader``).
    """
    data = config if config is not None else DataConfig()
    block_size = data.block_size or ModelConfig.max_seq_len
    vocab = vocab_size or data.vocab_size or ModelConfig.vocab_size
    seed = (data.seed or 0) if stream_seed is None else stream_seed
    if dataset is None:
        dataset = open_source(
            data,
            block_size=block_size,
            vocab_size=vocab,
            tokenizer=tokenizer,
            holdout=holdout,
            stream_seed=seed,
        )
    if isinstance(dataset, TextFileTokenDataset):
        dataset.shard_group = data.micro_batch_size  # workers deal whole batches (0-worker order)
    pin = data.pin_memory
    kwargs: dict[str, Any] = {
        "batch_size": data.micro_batch_size,
        "num_workers": data.num_workers,
        "pin_memory": bool(pin_memory_device) if pin is None else pin,
        "drop_last": data.drop_last,
        "collate_fn": collate_batch,
    }
    if data.num_workers > 0:
        if data.prefetch_factor is not None:  # else torch's default (2)
            kwargs["prefetch_factor"] = data.prefetch_factor
        kwargs["persistent_workers"] = True
    if isinstance(dataset, TokenWindowDataset):
        kwargs["sampler"] = TokenWindowSampler(
            dataset.num_tokens,
            dataset.block_size,
            sampling=data.sampling,
            shuffle=data.shuffle,
            seed=seed,
        )
    elif not isinstance(dataset, IterableDataset) and isinstance(dataset, Sized):
        kwargs["sampler"] = EpochSampler(len(dataset), shuffle=data.shuffle, seed=seed)
    return ResumableDataLoader(dataset, rank=rank, world_size=world_size, **kwargs)
