"""2.0.0 import path for DumbDiLoCo (the implementation lives in :mod:`speedtronic.diloco`).

Exports exactly the 2.0.0 names; submodules ``tensors``, ``outer``, ``hub`` and ``diloco``
mirror the old layout.
"""

from __future__ import annotations

from speedtronic.diloco import (
    DumbDiLoCo,
    DumbDiLoCoCoordinator,
    GlobalMetadata,
    HubError,
    HubUnavailable,
    MasterOuterLoop,
    NesterovOuterOptimizer,
    SyncResult,
    average_deltas,
    compute_pseudo_gradient,
    load_delta,
    load_safetensors,
    save_safetensors,
)
from speedtronic.diloco.hub import HubClient, HubTransport

__all__ = [
    "DumbDiLoCo",
    "DumbDiLoCoCoordinator",
    "GlobalMetadata",
    "HubClient",
    "HubError",
    "HubTransport",
    "HubUnavailable",
    "MasterOuterLoop",
    "NesterovOuterOptimizer",
    "SyncResult",
    "average_deltas",
    "compute_pseudo_gradient",
    "load_delta",
    "load_safetensors",
    "save_safetensors",
]
