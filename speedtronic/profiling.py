"""Compatibility path (2.0.0): ``speedtronic.profiling`` → :mod:`speedtronic.metrics`."""

from speedtronic.metrics.hooks import CallbackList, TrainingHook
from speedtronic.metrics.logger import MetricLogger, memory_usage_bytes

__all__ = ["CallbackList", "MetricLogger", "TrainingHook", "memory_usage_bytes"]
