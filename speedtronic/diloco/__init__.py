"""DumbDiLoCo: local inner steps, then one contribution per node per round, exchanged through
a Hub repository or a shared volume (``file:///abs/path``).

Modules: :mod:`.node` (a node's round, hooked on the inner optimizer) with :mod:`.mailbox`
(its inbox of globals and its uploader), :mod:`.master` (the master's round) with
:mod:`.roster` (the nodes it waits for), :mod:`.reconcile` (its agreement with the
published state) and :mod:`.outer_state` (its local state and write-ahead round record),
:mod:`.relay` (a group leader's
link to the top level), :mod:`.link` (what a node reads from and writes to the exchange: its
identity claim, uploads, globals), :mod:`.coordinator` (assembles them for the trainer),
:mod:`.outer`
(Nesterov outer optimizer), :mod:`.tensors` (format, pseudo-gradient), :mod:`.transport`
(repository layout), :mod:`.directory` (shared volume) and :mod:`.hub` (Hugging Face Hub)
below :mod:`.exchange` (picks one for a repo id), :mod:`.retry` (errors, retry policy),
:mod:`.identity` (node ids and claims). The same arithmetic run exactly in one process, the
peer the protocol is measured against, is :mod:`speedtronic.testing.diloco_ideal`.
Reporting: log lines go to the ``speedtronic.diloco`` logger, events to one
``emit(event, **fields)`` (:class:`.mailbox.Emit`). See docs/diloco.md.
"""

from __future__ import annotations

from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator, build_transport
from speedtronic.diloco.exchange import (
    GlobalMetadata,
    HubError,
    HubUnavailable,
    RemoteNotFound,
    RepoTransport,
    RetryPolicy,
    Transport,
    TransportError,
    average_deltas,
    compute_pseudo_gradient,
    load_delta,
    load_safetensors,
    parse_delta_path,
    save_safetensors,
)
from speedtronic.diloco.master import NesterovOuterOptimizer, RoundMaster
from speedtronic.diloco.node import Contribution, DiLoCoNode, GlobalCandidate, resolve_node_id

DumbDiLoCo = DumbDiLoCoCoordinator
#: 2.0.0 names: the master's aggregation loop and the upload job.
MasterOuterLoop = RoundMaster
DeltaUploadJob = Contribution


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
