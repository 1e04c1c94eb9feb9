"""Hook protocol and small helpers for attaching callbacks to a ``MetricLogger``.

A hook is either an object with ``on_event(event, payload)`` or a plain callable
``(event, payload)``. Append it to ``trainer.logger.hooks``. Set ``wants_all_steps = True`` on a
hook object to receive every ``train_step`` regardless of ``logging.every_steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from speedtronic.json_types import JSON

__all__ = ["CallbackList", "Hook", "TrainingHook", "on_event", "wants_all_steps"]


@runtime_checkable
class TrainingHook(Protocol):
    """Anything with ``on_event(event: str, payload: dict) -> None``."""

    def on_event(self, event: str, payload: JSON) -> None:
        """Receive one event (the payload dict is shared between hooks: do not mutate it)."""


Hook = TrainingHook | Callable[[str, JSON], object]
"""What ``MetricLogger.hooks`` holds: an ``on_event`` object or a plain callable."""


def wants_all_steps(hook: Hook) -> bool:
    """Whether ``hook`` asked for every ``train_step`` (``wants_all_steps = True``; a user's
    hook may not have the attribute)."""
    return bool(getattr(hook, "wants_all_steps", False))


def call(hook: Hook, event: str, payload: JSON) -> None:
    """Deliver one event to ``hook``, whichever of the two kinds it is."""
    if isinstance(hook, TrainingHook):
        hook.on_event(event, payload)
    elif callable(hook):
        hook(event, payload)


class CallbackList:
    """Fans one event out to several callbacks (hook objects or plain callables)."""

    def __init__(self, callbacks: list[Hook] | None = None) -> None:
        self.callbacks: list[Hook] = list(callbacks or [])

    @property
    def wants_all_steps(self) -> bool:
        """True when any member wants every ``train_step``."""
        return any(wants_all_steps(cb) for cb in self.callbacks)

    def on_event(self, event: str, payload: JSON) -> None:
        """Call every member in order (no exception isolation of its own)."""
        for callback in self.callbacks:
            call(callback, event, payload)


def on_event(
    callback: Callable[[str, JSON], object],
) -> Callable[[str, JSON], None]:
    """Wrap ``callback(event, payload)`` as a hook (usable as a decorator)."""

    def hook(event: str, payload: JSON) -> None:
        callback(event, payload)

    return hook
