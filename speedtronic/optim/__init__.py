"""Optimizers: parameter routing, Muon/Muon+, cautious updates, builders and LR schedules.

Modules:
    routing    -- ``route_parameters``: hidden matrices -> Muon, the rest -> AdamW
    muon       -- ``newton_schulz``, ``muon_update``, ``post_polar_normalize``,
                  ``resolve_ns_dtype``; ``Muon``, ``HybridOptimizer``, ``MuonSettings``
    cautious   -- ``CautiousOptimizer`` (Liang et al. 2024) over any optimizer
    build      -- ``build_optimizer(model, config, device)``, ``supports_fused_adamw(device)``
    schedules  -- ``build_scheduler(optimizer, config)`` (warmup + cosine/constant)
"""

from __future__ import annotations

from speedtronic.optim.build import (
    build_adamw,
    build_optimizer,
    build_v2_optimizer,
    supports_fused_adamw,
)
from speedtronic.optim.cautious import CautiousOptimizer, cautious_mask, cautious_step
from speedtronic.optim.muon import (
    NS_COEFFICIENTS,
    HybridOptimizer,
    Muon,
    MuonSettings,
    cpu_has_native_bf16,
    muon_update,
    newton_schulz,
    orthogonal_direction,
    post_polar_normalize,
    resolve_ns_dtype,
    shape_scale,
)
from speedtronic.optim.routing import (
    ROLE_ATTRIBUTE,
    ParameterRouting,
    assert_exactly_once,
    route_parameters,
    trainable_parameters,
)
from speedtronic.optim.schedules import LRSchedule, build_scheduler, schedule_from_config

__all__ = [
    "NS_COEFFICIENTS",
    "ROLE_ATTRIBUTE",
    "CautiousOptimizer",
    "HybridOptimizer",
    "LRSchedule",
    "Muon",
    "MuonSettings",
    "ParameterRouting",
    "assert_exactly_once",
    "build_adamw",
    "build_optimizer",
    "build_scheduler",
    "build_v2_optimizer",
    "cautious_mask",
    "cautious_step",
    "cpu_has_native_bf16",
    "muon_update",
    "newton_schulz",
    "orthogonal_direction",
    "post_polar_normalize",
    "resolve_ns_dtype",
    "route_parameters",
    "schedule_from_config",
    "shape_scale",
    "supports_fused_adamw",
    "trainable_parameters",
]
