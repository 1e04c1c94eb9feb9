"""Compatibility path (2.0.0): ``speedtronic.precision`` → :mod:`speedtronic.train.precision`."""

from speedtronic.train.precision import (
    PrecisionPlan,
    autocast_context,
    make_grad_scaler,
    parameter_count,
    resolve_device,
    resolve_precision,
    supports_fused_adamw,
)

__all__ = [
    "PrecisionPlan",
    "autocast_context",
    "make_grad_scaler",
    "parameter_count",
    "resolve_device",
    "resolve_precision",
    "supports_fused_adamw",
]
