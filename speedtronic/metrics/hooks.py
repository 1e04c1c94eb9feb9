"""Hook protocol and small helpers for attaching callbacks to a ``MetricLogger``.

A hook is either an object with ``on_event(event, payload)`` or a plain callable
``(event, payload)``. Append it to ``trainer.logger.hooks``. Set ``wants_all_steps = True`` on a
hook object to receive every ``train_step`` regardless of ``logging.every_steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["CallbackList", "TrainingHook", "on_event"]


class TrainingHook(Protocol):
    """Anything with ``on_event(event: str, payload: dict) -> None``."""

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Receive one event (the payload dict is shared between hooks: do not mutate it)."""


class CallbackList:
    """Fans one event out to several callbacks (hook objects or plain callables)."""

    def __init__(self, callbacks: list[Any] | None = None) -> None:
        self.callbacks: list[Any] = list(callbacks or [])

    @property
    def wants_all_steps(self) -> bool:
        """True when any member wants every ``train_step``."""
        return any(getattr(cb, "wants_all_steps", False) for cb in self.callbacks)

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Call every member in order (no exception isolation of its own)."""
        for callback in self.callbacks:
            handler = getattr(callback, "on_event", None)
            if handler:
                handler(event, payload)
            elif callable(callback):
                callback(event, payload)


def on_event(
    callback: Callable[[str, dict[str, Any]], Any],
) -> Callable[[str, dict[str, Any]], None]:
    """Wrap ``callback(event, payload)`` as a hook (usable as a decorator)."""

    def hook(event: str, payload: dict[str, Any]) -> None:
        callback(event, payload)

    return hook
