"""Helpers that act on arbitrary ``nn.Module`` objects through documented model hooks."""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

__all__ = ["CheckpointingModule", "set_gradient_checkpointing"]


@runtime_checkable
class CheckpointingModule(Protocol):
    """A model with the gradient checkpointing hook (``speedtronic.model.GPT`` has one)."""

    def set_gradient_checkpointing(self, enabled: bool) -> object:
        """Recompute activations in the backward pass when ``enabled``."""


_Module = TypeVar("_Module")


def set_gradient_checkpointing(module: _Module, enabled: bool = True) -> _Module:
    """Call ``module.set_gradient_checkpointing(bool(enabled))`` and return ``module``.

    Raises ``AttributeError`` when the module has no such hook (the trainer only warns).
    """
    if not isinstance(module, CheckpointingModule):
        raise AttributeError(
            "module must expose set_gradient_checkpointing(enabled) to use this feature"
        )
    module.set_gradient_checkpointing(bool(enabled))
    return module
