"""Who the master's round waits for: the nodes of the exchange and their status.

A node announces itself with its status record (``nodes/<id>/owner.json``: instance token,
``state`` training | done | aggregator, ``final_round`` when done). The roster keeps one
:class:`NodeView` per node, rebuilt from the repository after a restart, and answers three
questions for :class:`~speedtronic.diloco.master.RoundMaster`: which nodes the open round
waits for (joined, not finished, not a pure aggregator, not silent for ``drop_after`` round
lengths), whether a node finished its run, and whether the run is over. A record is read again
only when the repository listing shows a new version of it, so a poll costs one listing
however many nodes there are.

A status record is a claim, never proof: anyone who can write to the exchange can write one.
A node finished its run only by what the master aggregated (:meth:`Roster.finished`): its
record says ``done`` *and* the master's last aggregated contribution of that node came from
the record's instance and was flagged final, or the record's ``final_round`` is a round the
ledger holds (a node whose last delta was all zeros sends only the record).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from speedtronic.diloco.mailbox import Emit, ignore
from speedtronic.diloco.outer_state import RoundState
from speedtronic.diloco.transport import RepoScan

__all__ = ["IDENTITY_HEADERS", "NodeView", "Roster"]

_LOG = logging.getLogger("speedtronic.diloco")

# every contribution names these (the node writes them; see link.NodeLink.send)
IDENTITY_HEADERS = ("node_id", "round", "run_id", "instance", "base_outer_step")


@dataclasses.dataclass
class NodeView:
    """What the master knows about one node (rebuilt from the repository after a restart)."""

    node_id: str
    instance: str | None = None
    state: str = "training"  # training | done | aggregator
    final_round: int | None = None
    last_heard: float = 0.0  # monotonic: joined, or newest contribution seen
    dropped: bool = False


class Roster:
    """The nodes of one exchange, read from their status records (``read_owner`` of the
    transport); ``emit`` reports joins, drops and rejoins."""

    def __init__(
        self,
        read_owner: Callable[[str], dict[str, Any] | None],
        emit: Emit = ignore,
    ):
        self._read_owner = read_owner
        self._emit = emit
        self.nodes: dict[str, NodeView] = {}
        self.saw_training = False  # a node that trains announced itself (the run has begun)
        self._records: dict[str, tuple[str, dict[str, Any]]] = {}  # node -> (version, record)

    def refresh(self, scan: RepoScan, now: float, outer_step: int) -> bool:
        """Update every node from its status record (a restarted node is a new view); True
        when a record is new or changed since the last refresh (a sign of progress)."""
        changed = False
        for node_id in sorted(scan.owners):
            view = self.nodes.get(node_id)
            before = self._records.get(node_id)
            record = self._record(node_id, scan)
            changed |= before is None or before[1] != record
            instance = record.get("instance")
            if view is None or (instance and instance != view.instance):
                view = NodeView(node_id, instance=instance, last_heard=now)
                self.nodes[node_id] = view
                if record.get("state", "training") == "training":
                    self._emit("node_joined", node_id=node_id, outer_step=outer_step)
            state = str(record.get("state", view.state))
            if view.state == "done" and state == "training":
                view.last_heard = now  # restarted after it had finished: waiting again
            view.state = state
            final = record.get("final_round")
            view.final_round = final if isinstance(final, int) else None
            if view.state == "training":
                self.saw_training = True
        return changed

    def _record(self, node_id: str, scan: RepoScan) -> dict[str, Any]:
        """A node's status record, read again only when the listing shows a new version of
        it: a poll costs one listing, not one read per node (K grows, requests do not)."""
        info = scan.files.get(f"nodes/{node_id}/owner.json")
        version = info.version if info is not None else None
        cached = self._records.get(node_id)
        if version is not None and cached is not None and cached[0] == version:
            return cached[1]
        record = self._read_owner(node_id) or {}
        if version is not None:
            self._records[node_id] = (version, record)
        return record

    def heard(self, node_id: str, now: float, outer_step: int) -> None:
        """A contribution of ``node_id`` arrived: it is not silent (a dropped node rejoins)."""
        view = self.nodes.get(node_id)
        if view is None:  # contributions without a status record are used, never waited for
            return
        if view.dropped:
            view.dropped = False
            self._emit("node_rejoined", node_id=node_id, outer_step=outer_step)
        view.last_heard = max(view.last_heard, now)

    def check_identity(
        self,
        node_id: str,
        header: Mapping[str, str],
        round: int,
        outer_step: int,
        relay_leaders: Collection[str],
    ) -> int:
        """A contribution to ``round`` found under ``nodes/<node_id>/`` names its node, round,
        run, instance and base, matches its path, comes from the node's current instance, and
        is based on a global the master published (``ValueError`` otherwise). Returns its
        weight: 1, or for a node in ``relay_leaders`` the number of nodes it speaks for."""
        missing = [key for key in IDENTITY_HEADERS if key not in header]
        if missing:
            raise ValueError(
                f"no {', '.join(missing)} in its header (a node names its node, round, run, "
                "instance and base outer step in every contribution)"
            )
        if header["node_id"] != node_id or header["round"] != str(round):
            raise ValueError("its header names another node or round than its path")
        instance = header["instance"]
        if not instance:
            raise ValueError("an empty instance in its header")
        base = int(header["base_outer_step"])
        if not -1 <= base <= outer_step:  # -1: measured from the node's initial weights
            raise ValueError(f"based on outer step {base}, which this master never published")
        view = self.nodes.get(node_id)
        if view is not None and view.instance and instance != view.instance:
            raise ValueError(f"written by instance {instance}, not the node's {view.instance}")
        weight = int(header.get("weight", "1"))
        if weight != 1 and node_id not in relay_leaders:
            raise ValueError(
                f"weight {weight} from {node_id}, which is not a relay leader (only nodes "
                "listed in the top master's distributed.relay_leaders may weigh more than 1)"
            )
        if not 1 <= weight <= 1_000_000:
            raise ValueError(f"weight {weight} is not a number of nodes")
        return weight

    def credit(self, seconds: float) -> None:
        """Time the exchange could not be read: nobody was silent during it."""
        for view in self.nodes.values():
            view.last_heard += seconds

    @staticmethod
    def finished(view: NodeView, state: RoundState) -> bool:
        """Done with its run by what the master aggregated (see the module docstring): the
        record says ``done``, the node's last aggregated contribution came from the record's
        instance, and it was flagged final or the ledger holds the record's ``final_round``."""
        node = view.node_id
        if view.state != "done" or not view.instance:
            return False
        if state.instances.get(node) != view.instance:
            return False  # nothing aggregated from the instance that claims to be done
        if node in state.finals:
            return True
        final = view.final_round
        return final is not None and final >= 0 and state.ledger.get(node, -1) >= final

    def finished_count(self, state: RoundState) -> int:
        """How many nodes finished their run."""
        return sum(self.finished(view, state) for view in self.nodes.values())

    def _expected(self, view: NodeView, state: RoundState) -> bool:
        """Neither finished nor a pure aggregator (which never contributes)."""
        return view.state != "aggregator" and not self.finished(view, state)

    def waiting(self, state: RoundState) -> set[str]:
        """Nodes expected and not dropped (no clock: what a closing round still expects)."""
        return {n for n, v in self.nodes.items() if self._expected(v, state) and not v.dropped}

    def active(self, now: float, limit: float, state: RoundState) -> set[str]:
        """Nodes the open round waits for; a node silent for more than ``limit`` seconds is
        dropped (logged and reported once) until it delivers again."""
        active = set()
        for view in self.nodes.values():
            if not self._expected(view, state):
                continue
            silent = now - view.last_heard
            if silent > limit and not view.dropped:
                view.dropped = True
                _LOG.warning(
                    f"node {view.node_id} silent for {silent:.0f} s; no longer waiting for it "
                    "(it rejoins when it delivers again)"
                )
                self._emit("node_dropped", node_id=view.node_id, silent_seconds=silent)
            if not view.dropped:
                active.add(view.node_id)
        return active

    def run_over(self, active: set[str], state: RoundState) -> bool:
        """No node left to wait for, and at least one finished its run (nodes that are only
        silent, e.g. all at once, keep the run open until one of them is done)."""
        return self.saw_training and not active and self.finished_count(state) > 0
