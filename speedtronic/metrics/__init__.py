"""Metrics: the ``MetricLogger`` event sink, hooks, optional adapters and plotting.

``speedtronic.metrics.prometheus`` and ``speedtronic.metrics.server`` (the container exporter)
are separate modules and are not imported here.
"""

from __future__ import annotations

from speedtronic.metrics.hooks import CallbackList, TrainingHook, on_event
from speedtronic.metrics.logger import REDACTED, MetricLogger, memory_usage_bytes

__all__ = [
    "REDACTED",
    "CallbackList",
    "MetricLogger",
    "TrainingHook",
    "memory_usage_bytes",
    "on_event",
]
