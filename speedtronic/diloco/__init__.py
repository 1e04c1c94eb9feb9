"""DumbDiLoCo: local inner steps, then a pseudo-gradient exchange through a Hub repository
or a shared volume (``file:///abs/path``).

Modules: :mod:`.tensors` (format, pseudo-gradient), :mod:`.transport` (protocol, errors,
retry policy, layout), :mod:`.directory` (shared volume), :mod:`.hub` (Hugging Face Hub),
:mod:`.outer` (Nesterov outer optimizer, master loop), :mod:`.coordinator` (the trainer's
sync coordinator: the round state machine) with its lanes :mod:`.delta_lane` (pseudo-gradient
uploads), :mod:`.global_lane` (global polls) and :mod:`.master_lane` (the master's outer loop),
:mod:`.rounds` (round data) and :mod:`.identity` (node ids and claims). See docs/diloco.md.
"""

from __future__ import annotations

import dataclasses

from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic.diloco.identity import resolve_node_id
from speedtronic.diloco.outer import MasterOuterLoop, NesterovOuterOptimizer
from speedtronic.diloco.rounds import DeltaUploadJob, GlobalCandidate, RoundPhase
from speedtronic.diloco.tensors import (
    average_deltas,
    compute_pseudo_gradient,
    load_delta,
    load_safetensors,
    parse_delta_path,
    save_safetensors,
)
from speedtronic.diloco.transport import (
    GlobalMetadata,
    HubError,
    HubUnavailable,
    RemoteNotFound,
    RepoTransport,
    RetryPolicy,
    Transport,
    TransportError,
    build_transport,
)

DumbDiLoCo = DumbDiLoCoCoordinator


@dataclasses.dataclass
class SyncResult:
    """2.0.0 compatibility record (exported, never produced)."""

    pushed: bool = False
    loaded_global: bool = False
    outer_step: int = 0


def __getattr__(name: str):
    """``HubClient``/``HubTransport``/``DirectoryTransport`` load their modules on first use."""
    if name in ("HubClient", "HubTransport"):
        from speedtronic.diloco import hub

        return getattr(hub, name)
    if name == "DirectoryTransport":
        from speedtronic.diloco.directory import DirectoryTransport

        return DirectoryTransport
    raise AttributeError(name)


__all__ = [
    "DeltaUploadJob",
    "DirectoryTransport",
    "DumbDiLoCo",
    "DumbDiLoCoCoordinator",
    "GlobalCandidate",
    "GlobalMetadata",
    "HubClient",
    "HubError",
    "HubTransport",
    "HubUnavailable",
    "MasterOuterLoop",
    "NesterovOuterOptimizer",
    "RemoteNotFound",
    "RepoTransport",
    "RetryPolicy",
    "RoundPhase",
    "SyncResult",
    "Transport",
    "TransportError",
    "average_deltas",
    "build_transport",
    "compute_pseudo_gradient",
    "load_delta",
    "load_safetensors",
    "parse_delta_path",
    "resolve_node_id",
    "save_safetensors",
]
