"""Compatibility module: the 2.0.0 ``speedtronic.optimizers`` names (now ``speedtronic.optim``)."""

from __future__ import annotations

from speedtronic.optim import (
    CautiousOptimizer,
    HybridOptimizer,
    Muon,
    ParameterRouting,
    build_v2_optimizer,
    newton_schulz,
    post_polar_normalize,
    route_parameters,
)

__all__ = [
    "CautiousOptimizer",
    "HybridOptimizer",
    "Muon",
    "ParameterRouting",
    "build_v2_optimizer",
    "newton_schulz",
    "post_polar_normalize",
    "route_parameters",
]
