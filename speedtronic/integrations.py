"""Compatibility path (2.0.0): re-exports ``speedtronic.metrics.integrations``."""

from speedtronic.metrics.integrations import TensorboardHook, WandbHook

__all__ = ["TensorboardHook", "WandbHook"]
