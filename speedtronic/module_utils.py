"""Helpers that act on arbitrary ``nn.Module`` objects through documented model hooks."""

from __future__ import annotations

from typing import Any

__all__ = ["set_gradient_checkpointing"]


def set_gradient_checkpointing(module: Any, enabled: bool = True) -> Any:
    """Call ``module.set_gradient_checkpointing(bool(enabled))`` and return ``module``.

    Raises ``AttributeError`` when the module has no such hook (the trainer only warns).
    """
    hook = getattr(module, "set_gradient_checkpointing", None)
    if not callable(hook):
        raise AttributeError(
            "module must expose set_gradient_checkpointing(enabled) to use this feature"
        )
    hook(bool(enabled))
    return module
