"""The user-model contract: how a batch is moved, counted, fed to the model, and a loss found.

Batches: a dict is passed as keyword arguments (``model(**batch)``); a tuple/list as
``model(inputs, labels)``. Outputs: a tensor is the loss; a dict must hold ``"loss"`` (or causal
``"logits"`` with ``labels`` in the batch); a tuple/list starts with the loss (or 3-D logits).
Labels are already next-token aligned (``labels[i]`` is the token after ``input_ids[i]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

Batch = object
"""A user's batch: a dict of tensors, a tuple/list ``(inputs, labels)`` or a tensor."""

__all__ = [
    "Batch",
    "MissingLossError",
    "batch_size_and_tokens",
    "call_model",
    "labels_of",
    "move_to_device",
    "read_update_values",
    "resolve_loss",
]


class MissingLossError(ValueError):
    """The model's output contains no loss the trainer can optimise."""


def move_to_device(batch: Batch, device: torch.device) -> Batch:
    """Recursively move tensors in dicts/tuples/lists to ``device`` (non-blocking)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list):
        return [move_to_device(value, device) for value in batch]
    if isinstance(batch, tuple):
        return tuple(move_to_device(value, device) for value in batch)
    return batch


def batch_size_and_tokens(batch: Batch) -> tuple[int, int | torch.Tensor]:
    """Samples and tokens in one micro-batch.

    Tokens are the attention-mask sum when the batch has one (returned as a 0-d tensor so the
    trainer can read it in its single per-step host sync), else ``input_ids.numel()``.
    """
    if isinstance(batch, dict):
        candidate = batch.get("input_ids", batch.get("inputs"))
    elif isinstance(batch, (tuple, list)) and batch:
        candidate = batch[0]
    else:
        candidate = batch
    if not isinstance(candidate, torch.Tensor) or candidate.ndim == 0:
        return 1, 1
    samples = int(candidate.shape[0])
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(mask, torch.Tensor) and candidate.ndim > 1:
        return samples, mask.sum()
    return samples, candidate.numel()


def call_model(model: Callable[..., object], batch: Batch) -> object:
    """Run the forward pass for one batch (dict → kwargs, tuple → ``(inputs, labels)``)."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        if len(batch) < 2:
            raise ValueError("tuple batches must contain inputs and labels")
        return model(batch[0], batch[1])
    raise TypeError(f"unsupported batch type: {type(batch).__name__}")


def labels_of(batch: Batch) -> torch.Tensor | None:
    """The labels of a batch (``batch["labels"]`` or ``batch[1]``), None when it has none."""
    if isinstance(batch, dict):
        labels = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) > 1:
        labels = batch[1]
    else:
        labels = None
    return labels if isinstance(labels, torch.Tensor) else None


def loss_from_logits(logits: object, batch: Batch) -> torch.Tensor | None:
    """Causal cross-entropy of ``(B, T, V)`` logits against already-aligned labels, or None."""
    labels = labels_of(batch)
    if not isinstance(logits, torch.Tensor) or labels is None:
        return None
    if logits.ndim != 3 or labels.ndim != 2 or labels.shape[0] != logits.shape[0]:
        return None
    if labels.shape[1] == logits.shape[1]:
        aligned = logits
    elif labels.shape[1] == logits.shape[1] - 1:
        aligned = logits[:, :-1]
    else:
        return None
    if labels.numel() == 0 or bool((labels == -100).all()):
        return logits.sum() * 0.0
    vocab = aligned.shape[-1]
    return F.cross_entropy(
        aligned.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=-100
    )


def resolve_loss(output: object, batch: Batch, *, model_name: str = "model") -> torch.Tensor:
    """The scalar loss in a model's output (see the module docstring for accepted forms)."""
    loss: object = None
    if isinstance(output, dict):
        loss = output["loss"] if "loss" in output else loss_from_logits(output.get("logits"), batch)
        if loss is None:
            raise MissingLossError(
                f"{model_name} returned a mapping without 'loss' (and no causal 'logits' with "
                "batch labels to infer one); return a loss tensor, {'loss': ...} or (loss, ...)"
            )
    elif isinstance(output, (tuple, list)) and output:
        first = output[0]
        if not isinstance(first, torch.Tensor):
            raise MissingLossError(
                f"{model_name} returned a tuple that does not start with a loss tensor"
            )
        loss = loss_from_logits(first, batch) if first.ndim == 3 else None
        loss = first if loss is None else loss
    elif isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise MissingLossError(
            f"{model_name} must return a loss tensor, a mapping with 'loss', or (loss, ...); "
            f"got {type(output).__name__}"
        )
    if not loss.is_floating_point():
        raise MissingLossError(f"{model_name} returned a non-floating-point loss ({loss.dtype})")
    return loss if loss.ndim == 0 else loss.mean()


class BatchStream:
    """Endless batches from a re-iterable loader.

    The first batch is fetched at construction, so everything a DataLoader draws from the global
    RNG when it starts (worker base seeds) happens before the trainer restores a checkpointed RNG
    state. One empty pass is tolerated (a resumable loader restored exactly at the end of an
    epoch); two in a row mean the loader has no data (``RuntimeError``).
    """

    _NOTHING = object()

    def __init__(self, loader: Iterable[Batch]) -> None:
        self.loader = loader
        self._iterator = iter(loader)
        self._produced = False
        self._first = self._NOTHING
        self._first = self._next()

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        if self._first is not self._NOTHING:
            first, self._first = self._first, self._NOTHING
            return first
        return self._next()

    def _next(self) -> Batch:
        empty_passes = 0
        while True:
            try:
                batch = next(self._iterator)
            except StopIteration:
                empty_passes += 0 if self._produced else 1
                if empty_passes >= 2:
                    raise RuntimeError("data loader produced no batches") from None
                self._iterator = iter(self.loader)
                self._produced = False
                continue
            self._produced = True
            return batch


def read_update_values(
    losses: list[torch.Tensor],
    grad_norm: torch.Tensor | None,
    token_counts: list[torch.Tensor],
    device: torch.device,
) -> tuple[float, float | None, int]:
    """An update's only host sync: the mean micro-batch loss, the gradient norm (``None``
    without one) and the summed masked token counts (0 without any), read in one transfer
    (float64; float32 on MPS, which has no float64)."""
    wide = torch.float32 if device.type == "mps" else torch.float64
    parts = [torch.stack(losses).to(wide).mean()]
    if grad_norm is not None:
        parts.append(grad_norm.to(wide))
    if token_counts:
        parts.append(torch.stack(token_counts).to(wide).sum())
    values = torch.stack(parts).tolist()
    norm = values[1] if grad_norm is not None else None
    return values[0], norm, int(values[-1]) if token_counts else 0
