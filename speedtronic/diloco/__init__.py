"""DumbDiLoCo: local inner steps, then one contribution per node per round, exchanged through
a Hub repository or a shared volume (``file:///abs/path``).

One module a role:

- :mod:`.node`: a node's round, hooked on the inner optimizer, with its inbox of globals, its
  uploader, its link to the exchange and its identity;
- :mod:`.master`: the master's round (one class), with the nodes it waits for, its agreement
  with the published state, its round state and local file, and the outer step;
- :mod:`.relay`: a group leader's link to the top-level exchange;
- :mod:`.exchange`: the layout, the ``Store`` protocol, and the one reporting channel (log
  lines to the ``speedtronic.diloco`` logger, events to one ``emit(event, **fields)``,
  :class:`.exchange.Emit`);
- :mod:`.codec`: the wire format: the contribution, how its values are encoded (casts,
  int8/int4 codes) and the safetensors files that carry it, with the checks every read passes;
- :mod:`.directory` and :mod:`.hub`: the stores (shared volume, Hugging Face Hub with the
  HTTP layer that bounds its calls); errors and the one retry policy are in :mod:`.exchange`;
- :mod:`.coordinator`: the wiring, from the ``distributed`` config section to the trainer.

The same arithmetic run exactly in one process, the peer the protocol is measured against,
is :mod:`speedtronic.testing.diloco_ideal`. See docs/diloco.md.
"""

from __future__ import annotations

from speedtronic.diloco.codec import (
    average_deltas,
    compute_pseudo_gradient,
    load_delta,
    load_safetensors,
    save_safetensors,
)
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
    parse_delta_path,
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
