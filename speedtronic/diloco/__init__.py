"""DumbDiLoCo: local inner steps, then one contribution per node per round, exchanged through
a Hub repository or a shared volume (``file:///abs/path``). One module a role: docs/diloco.md
has the table; :mod:`.coordinator` is the entry (the trainer's ``SyncCoordinator``)."""

from __future__ import annotations

from speedtronic.diloco.codec import (
    average_deltas,
    compute_pseudo_gradient,
    load_delta,
    load_safetensors,
    save_safetensors,
)
from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator, build_transport
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import (
    GlobalMetadata,
    HubError,
    RepoTransport,
    Transport,
    parse_delta_path,
)
from speedtronic.diloco.hub import HubClient, HubTransport
from speedtronic.diloco.link import resolve_node_id
from speedtronic.diloco.master import NesterovOuterOptimizer, RoundMaster
from speedtronic.diloco.node import Contribution, DiLoCoNode, GlobalCandidate
from speedtronic.retry import HubUnavailable, RemoteNotFound, RetryPolicy, TransportError

DumbDiLoCo = DumbDiLoCoCoordinator
#: 2.0.0 names: the master's aggregation loop and the upload job.
MasterOuterLoop = RoundMaster
DeltaUploadJob = Contribution

__all__ = [
    "Contribution",
    "DeltaUploadJob",
    "DiLoCoNode",
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
    "RoundMaster",
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
