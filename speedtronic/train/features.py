"""Optional trainer features switched on by config: gradient checkpointing, compile, OOO.

Each is set up once, never fatal: a missing model hook or a failing ``torch.compile`` degrades to
the plain path with a warning or an event (``compile``, ``ooo_backprop``). Each takes the one
value it needs (the trainer reads them from its typed ``SpeedtronicConfig``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic.module_utils import CheckpointingModule

if TYPE_CHECKING:
    from speedtronic.metrics.logger import MetricLogger
    from speedtronic.train.ooo import StageStreamScheduler

__all__ = [
    "apply_gradient_checkpointing",
    "compile_model",
    "make_ooo_scheduler",
]


def apply_gradient_checkpointing(model: nn.Module, enabled: bool, logger: MetricLogger) -> None:
    """Call ``model.set_gradient_checkpointing(True)`` when ``enabled`` (warn if impossible)."""
    if not enabled:
        return
    if not isinstance(model, CheckpointingModule):
        logger.warning(
            "gradient checkpointing requested but model has no set_gradient_checkpointing hook"
        )
        return
    try:
        model.set_gradient_checkpointing(True)
    except Exception as exc:
        logger.warning("gradient checkpointing hook failed; continuing without it: %s", exc)


def compile_model(
    model: nn.Module, enabled: bool, logger: MetricLogger
) -> tuple[Callable[..., object], bool]:
    """``(torch.compile(model), True)`` when ``enabled`` and wrapping works, else
    ``(model, False)``; emits ``compile {enabled[, reason]}`` when compile was requested."""
    if not enabled:
        return model, False
    try:
        compiled = torch.compile(model)
    except Exception as exc:
        logger.emit("compile", {"enabled": False, "reason": str(exc)})
        return model, False
    logger.emit("compile", {"enabled": True})
    return compiled, True


def make_ooo_scheduler(
    model: nn.Module,
    device: torch.device,
    logger: MetricLogger,
    *,
    enabled: bool,
    num_streams: int,
    compiled: bool,
) -> StageStreamScheduler | None:
    """A ``StageStreamScheduler`` with ``num_streams`` streams when ``enabled`` (the
    ``ooo_backprop`` setting) and compile is not; else None.

    Emits ``ooo_backprop`` with the scheduler summary (or the compile conflict).
    """
    if not enabled:
        return None
    if compiled:
        logger.warning(
            "ooo_backprop is disabled when compile is enabled; use one scheduling mode at a time"
        )
        logger.emit("ooo_backprop", {"enabled": False, "reason": "compile is enabled"})
        return None
    from speedtronic.train.ooo import StageStreamScheduler

    scheduler = StageStreamScheduler(model, device, num_streams=num_streams, logger=logger)
    logger.emit("ooo_backprop", scheduler.as_dict())
    return scheduler
