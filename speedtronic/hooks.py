"""Compatibility path (2.0.0): ``speedtronic.hooks`` → :mod:`speedtronic.metrics.hooks`."""

from speedtronic.metrics.hooks import CallbackList, TrainingHook, on_event

__all__ = ["CallbackList", "TrainingHook", "on_event"]
