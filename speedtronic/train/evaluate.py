"""Held-out evaluation: materialise the held-out batches once, score any model on them.

::

    from speedtronic.train.evaluate import build_heldout, evaluate

    heldout = build_heldout(config)            # HeldOut, or None without held-out data
    result = evaluate(model, heldout, device=torch.device("cpu"))
    result.loss, result.perplexity, result.tokens

``build_heldout`` reads the held-out region named by the ``eval`` section (see
:mod:`speedtronic.data.heldout`) from its start, in order, until ``eval.tokens`` target tokens
are collected (whole windows/samples, so it rounds up), and keeps them as CPU tensors in
batches of ``eval.batch_size`` (default ``data.micro_batch_size``). It reads the same region on
every node (only ``data.seed`` matters), so numbers from different nodes are comparable.

``evaluate`` returns the mean next-token cross-entropy in nats over every scored target token
(batches weighted by their target count), with the model in eval mode under ``no_grad`` and
autocast as in training; the model's train/eval mode is restored afterwards. It reads the
model and the held-out tensors only, so it is deterministic (same weights, same number) and
may run in another thread on another model object while training continues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from speedtronic.config import SpeedtronicConfig
from speedtronic.data.loader import collate_batch
from speedtronic.json_types import JSON
from speedtronic.train.forward import Batch, call_model, labels_of, move_to_device, resolve_loss
from speedtronic.train.precision import PrecisionPlan, autocast_context

__all__ = ["EvalResult", "HeldOut", "build_heldout", "evaluate"]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: ``loss`` (mean token cross-entropy, nats), ``perplexity`` (``e**loss``),
    ``tokens`` (target tokens scored)."""

    loss: float
    perplexity: float
    tokens: int

    def as_dict(self) -> JSON:
        """``{"loss", "perplexity", "tokens"}``."""
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens}


@dataclass(frozen=True)
class HeldOut:
    """The bounded held-out set, materialised once.

    ``batches``: collated batches as the trainer feeds them (``(inputs, labels)`` int64
    ``(B, T)`` CPU tensors for the built-in sources); ``tokens``: target tokens in them;
    ``requested``: ``eval.tokens`` (``tokens`` is smaller only when the region is shorter);
    ``description``: where the data comes from; ``floor``: the lowest reachable loss in nats
    when known (Markov data), else ``None``.
    """

    batches: tuple[Batch, ...]
    tokens: int
    requested: int
    description: str
    floor: float | None = None


def _target_count(batch: Batch) -> int:
    """Scored targets of a record or batch: labels that are not ``-100``."""
    labels = labels_of(batch)
    if labels is None:
        raise ValueError("held-out records must carry labels (a dict with 'labels' or a tuple)")
    return int((labels != -100).sum())


def build_heldout(config: SpeedtronicConfig) -> HeldOut | None:
    """The held-out batches of ``config`` (a ``SpeedtronicConfig``), or ``None`` without any.

    Raises ``ConfigError`` (naming the field) when the held-out source is unusable.
    """
    from speedtronic.config.tokenizer_file import is_bytes
    from speedtronic.data.heldout import open_heldout
    from speedtronic.data.tokenizer import tokenizer_for

    data, section = config.data, config.eval
    block_size = int(data.block_size or config.model.max_seq_len)
    tokenizer = None if is_bytes(data.tokenizer) else tokenizer_for(config)
    source = open_heldout(
        data,
        section,
        block_size=block_size,
        vocab_size=int(config.model.vocab_size),
        tokenizer=tokenizer,
    )
    if source is None:
        return None
    batch_size = int(section.batch_size or data.micro_batch_size)
    requested = int(section.tokens)
    batches: list[Batch] = []
    rows: list[dict[str, torch.Tensor]] = []
    tokens = 0
    for record in source.records():
        rows.append(record)
        tokens += _target_count(record)
        if len(rows) == batch_size or tokens >= requested:
            batches.append(collate_batch(rows))
            rows = []
        if tokens >= requested:
            break
    if rows:
        batches.append(collate_batch(rows))
    if tokens == 0:
        from speedtronic.config import ConfigError

        raise ConfigError(f"eval: the held-out data ({source.description}) has no target tokens")
    return HeldOut(tuple(batches), tokens, requested, source.description, source.floor)


def evaluate(
    model: nn.Module,
    heldout: HeldOut,
    *,
    device: str | torch.device,
    precision: PrecisionPlan | None = None,
) -> EvalResult:
    """Score ``model`` on ``heldout``: mean token cross-entropy (nats), perplexity, tokens.

    ``device`` is where the model lives (batches are copied there); ``precision`` the autocast
    plan (``None``: no autocast). The model runs in eval mode under ``torch.no_grad`` and its
    previous train/eval mode is restored, even on error.
    """
    device = torch.device(device)
    was_training = model.training
    wide = torch.float32 if device.type == "mps" else torch.float64
    total = torch.zeros((), dtype=wide, device=device)
    count = 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in heldout.batches:
                targets = _target_count(batch)
                if targets == 0:
                    continue
                moved = move_to_device(batch, device)
                if precision is not None:
                    with autocast_context(precision, device):
                        output = call_model(model, moved)
                else:
                    output = call_model(model, moved)
                loss = resolve_loss(output, moved, model_name="evaluated model")
                total += loss.detach().to(wide) * targets
                count += targets
    finally:
        model.train(was_training)
    mean = float(total.item()) / count if count else math.nan
    return EvalResult(loss=mean, perplexity=_perplexity(mean), tokens=count)


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
