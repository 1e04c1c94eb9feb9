"""Optional trainer features switched on by config: gradient checkpointing, compile, OOO.

Each is set up once, never fatal: a missing model hook or a failing ``torch.compile`` degrades to
the plain path with a warning or an event (``compile``, ``ooo_backprop``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "apply_gradient_checkpointing",
    "compile_model",
    "config_value",
    "make_ooo_scheduler",
]


def config_value(config: Any, path: str, default: Any = None) -> Any:
    """``config.a.b`` for ``path="a.b"``, or ``default`` when any link is missing or None.

    Lets the trainer run with a full ``SpeedtronicConfig``, a partial stand-in, or no config.
    """
    value = config
    for name in path.split("."):
        value = getattr(value, name, None)
        if value is None:
            return default
    return value


def apply_gradient_checkpointing(model: nn.Module, config: Any, logger: Any) -> None:
    """Call ``model.set_gradient_checkpointing(True)`` when requested (warn if impossible)."""
    requested = config_value(config, "gradient_checkpointing") or config_value(
        config, "model.gradient_checkpointing"
    )
    if not requested:
        return
    hook = getattr(model, "set_gradient_checkpointing", None)
    if not callable(hook):
        logger.warning(
            "gradient checkpointing requested but model has no set_gradient_checkpointing hook"
        )
        return
    try:
        hook(True)
    except Exception as exc:
        logger.warning("gradient checkpointing hook failed; continuing without it: %s", exc)


def compile_model(model: nn.Module, config: Any, logger: Any) -> tuple[Any, bool]:
    """``(torch.compile(model), True)`` when ``compile`` is on and wrapping works, else
    ``(model, False)``; emits ``compile {enabled[, reason]}`` when compile was requested."""
    value = config_value(config, "compile", False)
    if not bool(getattr(value, "enabled", value)):
        return model, False
    try:
        compiled = torch.compile(model)
    except Exception as exc:
        logger.emit("compile", {"enabled": False, "reason": str(exc)})
        return model, False
    logger.emit("compile", {"enabled": True})
    return compiled, True


def make_ooo_scheduler(
    model: nn.Module, device: torch.device, config: Any, logger: Any, *, compiled: bool
) -> Any:
    """A ``StageStreamScheduler`` when ``ooo_backprop`` is on and compile is not; else None.

    Emits ``ooo_backprop`` with the scheduler summary (or the compile conflict).
    """
    if not config_value(config, "ooo_backprop", False):
        return None
    if compiled:
        logger.warning(
            "ooo_backprop is disabled when compile is enabled; use one scheduling mode at a time"
        )
        logger.emit("ooo_backprop", {"enabled": False, "reason": "compile is enabled"})
        return None
    from speedtronic.train.ooo import StageStreamScheduler

    scheduler = StageStreamScheduler(
        model,
        device,
        num_streams=int(config_value(config, "ooo_streams", 4)),
        logger=logger,
    )
    logger.emit("ooo_backprop", scheduler.as_dict())
    return scheduler
