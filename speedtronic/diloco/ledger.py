"""The master's round bookkeeping: who a round waits for, what a round changes, and where it lives.

:class:`Roster` keeps one :class:`NodeView` per node from its status record; :class:`RoundState`
is everything a round changes (weights, ledger, node records), copied, changed and kept once the
exchange holds it; :func:`publish` is the one way a state goes to the exchange;
:func:`reconcile` agrees with the published state at start and after a failed publish; and
:class:`OuterStateStore` keeps the state in one atomic local file beside the write-ahead record
of the round being published (exactly once: a contribution is counted by the ledger that the
same commit publishes with the weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch.optim.optimizer import StateDict
from torch.optim.sgd import sgd as sgd_update

from speedtronic.background import wait_for
from speedtronic.checkpoint import atomic_json_dump, atomic_write_with
from speedtronic.diloco import codec
from speedtronic.diloco.codec import OuterUpdate
from speedtronic.diloco.exchange import (
    GLOBAL_PROCESSED,
    Emit,
    ExchangeError,
    FileInfo,
    GlobalMetadata,
    RepoScan,
    Store,
    beat_path,
    max_global_bytes,
    too_large,
)
from speedtronic.retry import HubUnavailable, TransportError

__all__ = [
    "IDENTITY_HEADERS",
    "META",
    "OUTER_CHUNK",
    "ContributionFiles",
    "NesterovOuterOptimizer",
    "NodeView",
    "OuterStateStore",
    "Roster",
    "RoundState",
    "publish",
    "reconcile",
]

_LOG = logging.getLogger("speedtronic.diloco")
V = TypeVar("V")
Record = Mapping[str, object]  # a node's status record (nodes/<id>/owner.json), as JSON

#: Every contribution names these in its header (the node writes them).
IDENTITY_HEADERS = ("node_id", "round", "run_id", "instance", "base_outer_step")
META = {"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd"}
CORRUPT_READS = 3  # reads of an unchanged record before its weights count as unusable
CORRUPT_WAIT = 0.2  # seconds before the second read (then twice that)
_FORMAT = "speedtronic-outer-state/2"


# -- who the round waits for -----------------------------------------------------------
@dataclasses.dataclass
class NodeView:
    """What the master knows about one node (rebuilt from the repository after a restart).

    ``joining``: announced and not waited for until it delivers (a node new to a run in
    progress, or back after it left: its rounds are not in step with the others' yet);
    ``beats``: it sends liveness beats (its record says so, or one was seen); ``last_beat``:
    when its beat last changed (None: none seen)."""

    node_id: str
    instance: str | None = None
    state: str = "training"  # training | done | left | aggregator
    final_round: int | None = None
    last_heard: float = 0.0  # monotonic: joined, or newest contribution seen
    dropped: bool = False
    joining: bool = False
    first_due: bool = False  # its next aggregated contribution is reported as its first
    beats: bool = False
    last_beat: float | None = None
    beat_version: str | None = None
    joined_at: float = 0.0  # monotonic: when this instance announced itself
    started: float | None = None  # wall clock: its process started (its record says)

    @property
    def last_seen(self) -> float:
        """The latest sign of life: announced, delivered or beat."""
        return max(self.last_heard, self.last_beat or 0.0)


class Roster:
    """One :class:`NodeView` per node, from its status record (``nodes/<id>/owner.json``:
    instance, ``state``, ``final_round``), read again only when the listing shows a new
    version of it (a poll costs one listing however many nodes there are), and its liveness
    beat (``nodes/<id>/beat.json``: only its listed version is read). A record is a claim,
    never proof: a node finished only by what the master aggregated (:meth:`finished`). A
    node that left (``state: left``) is not waited for; a node that beats is dropped after
    ``liveness`` seconds (0: off) without one: since its last beat when it beats
    ``periodic``-ally (a shared directory), else (the Hub: a beat only when waited for)
    since the open round began to wait for it. ``emit`` reports joins, leaves, drops and
    rejoins, each also one line of the log."""

    def __init__(
        self,
        read_owner: Callable[[str], Record | None],
        emit: Emit,
        liveness: float,
        periodic: bool,
    ):
        self._read_owner = read_owner
        self._emit = emit
        self.liveness, self.periodic = liveness, periodic
        self.nodes: dict[str, NodeView] = {}
        self.saw_training = False  # a node that trains announced itself (the run has begun)
        self._records: dict[str, tuple[str, Mapping[str, object]]] = {}  # node -> version, record

    def refresh(self, scan: RepoScan, now: float, state: RoundState) -> bool:
        """Update every node from its status record and its beat (a new instance is a new
        view; one that ``state`` lists as dropped stays dropped); True when a record is new
        or changed."""
        changed = False
        for node_id in sorted(scan.owners):
            view, before = self.nodes.get(node_id), self._records.get(node_id)
            record = self._record(node_id, scan)
            changed |= before is None or before[1] != record
            instance = str(record.get("instance") or "") or None
            if view is None or (instance and instance != view.instance):
                view = self._announced(node_id, record, now, state)
            status = str(record.get("state", view.state))
            if view.state != status:
                self._moved(view, record, now, state)
            view.state = status
            final = record.get("final_round")
            view.final_round = final if isinstance(final, int) else None
            self.saw_training |= view.state == "training"
            beat = scan.files.get(beat_path(node_id))
            if beat is not None and beat.version != view.beat_version:
                view.beat_version, view.last_beat = beat.version, now
            view.beats = record.get("beats") is True or view.last_beat is not None
        return changed

    def _announced(self, node_id: str, record: Record, now: float, state: RoundState) -> NodeView:
        """A new node or instance: its view. In a run in progress an instance none of whose
        contributions was aggregated yet is waited for only once it delivers."""
        instance = str(record.get("instance") or "") or None
        dropped = bool(instance) and state.dropped.get(node_id) == instance
        if instance and not dropped:  # a new instance of a dropped node: waited for
            state.dropped.pop(node_id, None)
        status = str(record.get("state", "training"))
        view = NodeView(node_id, instance, status, last_heard=now, dropped=dropped)
        view.joined_at, view.started = now, _number(record.get("started"))
        self.nodes[node_id] = view
        if dropped:
            _LOG.info(
                f"node {node_id} stays dropped (it was before this master restarted); "
                "it rejoins when it delivers"
            )
        elif status == "training":
            view.first_due = state.instances.get(node_id) != instance
            view.joining = state.outer_step > 0 and view.first_due
            self._joined(view, state, "joined")
        return view

    def _joined(self, view: NodeView, state: RoundState, how: str) -> None:
        """One line and a ``node_joined`` event."""
        wait = "waited for once it delivers" if view.joining else "waited for from this round"
        _LOG.info(f"node {view.node_id} {how} at outer step {state.outer_step} ({wait})")
        self._emit("node_joined", node_id=view.node_id, outer_step=state.outer_step)

    def _moved(self, view: NodeView, record: Record, now: float, state: RoundState) -> None:
        """The record's state changed: a node left, or came back after it left or finished."""
        status = record.get("state")
        if status == "left":
            resume = record.get("resume") is True
            again = "it may come back with --resume" if resume else "it will not come back"
            _LOG.info(
                f"node {view.node_id} left at outer step {state.outer_step}; no longer "
                f"waiting for it ({again})"
            )
            self._emit(
                "node_left", node_id=view.node_id, outer_step=state.outer_step, resume=resume
            )
        elif status == "training" and view.state in ("left", "done"):
            view.last_heard = view.joined_at = now  # its beats count from its return
            view.joining = view.state == "left"  # out of step with the others until it delivers
            if view.joining:
                view.first_due, view.started = True, _number(record.get("started"))
                self._joined(view, state, "is back")

    def _record(self, node_id: str, scan: RepoScan) -> Mapping[str, object]:
        info = scan.files.get(f"nodes/{node_id}/owner.json")
        version = info.version if info is not None else None
        cached = self._records.get(node_id)
        if version is not None and cached is not None and cached[0] == version:
            return cached[1]
        record = self._read_owner(node_id) or {}
        if version is not None:
            self._records[node_id] = (version, record)
        return record

    def heard(self, node_id: str, now: float, state: RoundState) -> None:
        """A contribution of ``node_id`` arrived: it is not silent (a dropped node rejoins,
        a joining one is waited for from now on). Contributions without a status record
        are used, never waited for."""
        view = self.nodes.get(node_id)
        if view is None:
            return
        view.joining = False
        if view.dropped:
            view.dropped = False
            state.dropped.pop(node_id, None)
            _LOG.info(f"node {node_id} delivered again; waiting for it from now on")
            self._emit("node_rejoined", node_id=node_id, outer_step=state.outer_step)
        view.last_heard = max(view.last_heard, now)

    def check_identity(
        self,
        node_id: str,
        header: Mapping[str, str],
        round: int,
        outer_step: int,
        relay_leaders: Collection[str],
    ) -> int:
        """A contribution to ``round`` under ``nodes/<node_id>/`` names its node, round, run,
        instance and base, matches its path, comes from the node's current instance and is
        based on a published global (else ``ValueError``). Returns its weight: 1, or for a node
        in ``relay_leaders`` the number of nodes it speaks for."""
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
            if view.last_beat is not None:
                view.last_beat += seconds

    @staticmethod
    def finished(view: NodeView, state: RoundState) -> bool:
        """Done by what the master aggregated: the record says ``done``, the node's last
        aggregated contribution came from the record's instance, and it was flagged final or
        the ledger holds the record's ``final_round``."""
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
        return view.state not in ("aggregator", "left") and not self.finished(view, state)

    def waiting(self, state: RoundState) -> set[str]:
        """Nodes expected and not dropped, joining ones too (no clock: what a closing round
        still expects)."""
        return {n for n, v in self.nodes.items() if self._expected(v, state) and not v.dropped}

    def active(
        self, now: float, limit: float, state: RoundState, since: float | None = None
    ) -> set[str]:
        """Nodes the open round waits for (expected, not joining); it has waited ``since``
        its first on-time contribution (None: not yet). One silent for more than ``limit``
        seconds, or without a beat for ``liveness``, is dropped (reported once, recorded in
        ``state.dropped``) until it delivers again."""
        active = set()
        for view in self.nodes.values():
            if not self._expected(view, state):
                continue
            why = self._silence(view, now, limit, since)
            if why and not view.dropped:
                view.dropped = True
                state.dropped[view.node_id] = view.instance or ""
                _LOG.warning(
                    f"node {view.node_id} {why}; no longer waiting for it (it rejoins when it "
                    "delivers again)"
                )
                silent = now - view.last_seen
                self._emit("node_dropped", node_id=view.node_id, silent_seconds=silent)
            if not view.dropped and not view.joining:
                active.add(view.node_id)
        return active

    def _silence(self, view: NodeView, now: float, limit: float, since: float | None) -> str | None:
        """Why ``view`` counts as gone: no contribution for ``limit`` seconds, or no beat
        for ``liveness`` seconds (see the class); None while it is not."""
        silent = now - view.last_heard
        if silent > limit:
            return f"silent for {silent:.0f} s"
        if self.liveness <= 0 or not view.beats:
            return None
        if self.periodic:
            quiet = now - max(view.joined_at, view.last_beat or 0.0)
        elif since is None or max(view.last_heard, view.last_beat or 0.0) >= since:
            return None  # not waited for yet, or alive since: round_timeout bounds the round
        else:
            quiet = now - since
        if quiet <= self.liveness:
            return None
        return f"sent no liveness beat for {quiet:.1f} s (liveness_timeout {self.liveness:g} s)"

    def last_seen(self, now: float) -> dict[str, float]:
        """Seconds since each training node (not done, not left) was last seen."""
        gone = ("left", "done", "aggregator")
        return {
            v.node_id: now - v.last_seen for v in list(self.nodes.values()) if v.state not in gone
        }

    def run_over(self, active: set[str], state: RoundState) -> bool:
        """No node left to wait for or joining, and at least one finished (nodes that are
        only silent keep the run open until one of them is done)."""
        joining = any(v.joining and self._expected(v, state) for v in self.nodes.values())
        return self.saw_training and not active and not joining and self.finished_count(state) > 0


# -- the round state -------------------------------------------------------------------
@dataclasses.dataclass
class RoundState:
    """The master's whole mutable round state.

    ``outer_step``: the published global's (= the open round); ``global_state``: its weights
    in the model's dtypes; ``optimizer``: the run's one outer optimizer (shared by copies);
    ``ledger``: node -> highest round aggregated (or dropped as stale); ``digests``: node ->
    sha256 of its last aggregated contribution (a re-sent copy is refused); ``instances``:
    node -> the instance of that contribution; ``finals``: node -> the round of its
    contribution flagged final; ``dropped``: node -> the instance no longer waited for (kept
    across a restart until it delivers); ``round_seconds``: the moving average of round
    lengths (the drop limit counts in it); ``residual``: what the quantized global updates
    left out (error feedback); ``eta``: the outer lr of the step that made the global (in
    every published record).
    """

    outer_step: int
    global_state: dict[str, torch.Tensor]
    optimizer: NesterovOuterOptimizer
    run_id: str = ""
    ledger: dict[str, int] = dataclasses.field(default_factory=dict)
    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    instances: dict[str, str] = dataclasses.field(default_factory=dict)
    finals: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)
    round_seconds: float = 0.0
    residual: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    eta: float = 1.0

    def copy(self, *, tensors: bool = True) -> RoundState:
        """New records over the same optimizer; the weights and residual cloned, or with
        ``tensors=False`` new dicts over the same tensors (a reconcile replaces tensors, never
        writes into them)."""
        clone = codec.cpu_state_dict if tensors else dict
        return dataclasses.replace(
            self,
            global_state=clone(self.global_state),
            ledger=dict(self.ledger),
            digests=dict(self.digests),
            instances=dict(self.instances),
            finals=dict(self.finals),
            dropped=dict(self.dropped),
            residual=clone(self.residual) if tensors else self.residual,
        )

    def node_records(self) -> dict[str, dict[str, object]]:
        """What the published ledger carries of each node beside its round, so that a master
        adopting the global knows who finished, as which instance, and who was dropped."""
        return {
            "finals": dict(self.finals),
            "instances": dict(self.instances),
            "digests": dict(self.digests),
            "dropped": dict(self.dropped),
        }

    def take_node_records(
        self, records: Mapping[str, Mapping[str, object]], *, newer: bool
    ) -> None:
        """Merge published ``records``: they replace this state's when ``newer`` (the global
        was adopted), else they only fill what it lacks."""

        def merged(mine: dict[str, V], name: str) -> dict[str, V]:
            published = cast(dict[str, V], dict(records.get(name) or {}))
            return {**mine, **published} if newer else {**published, **mine}

        self.finals = merged(self.finals, "finals")
        self.instances = merged(self.instances, "instances")
        self.digests = merged(self.digests, "digests")
        self.dropped = merged(self.dropped, "dropped")

    def adopt(self, state: Mapping[str, torch.Tensor], outer_step: int) -> None:
        """Take a published global (cast to this state's dtypes; other keys and shapes are
        ignored) at ``outer_step``; the run's outer optimizer forgets its momentum."""
        for key, value in state.items():
            mine = self.global_state.get(key)
            if mine is not None and tuple(value.shape) == tuple(mine.shape):
                self.global_state[key] = codec.cpu_tensor(value).to(mine.dtype)
        self.outer_step = int(outer_step)
        self.optimizer.reset()


def publish(
    store: Store,
    state: RoundState,
    *,
    prune: Iterable[str] = (),
    final: bool = False,
    refused: Iterable[str] = (),
    update: OuterUpdate | None = None,
    moments: Mapping[str, torch.Tensor] | None = None,
    moments_round: int | None = None,
    weights: bool = True,
    last_update: OuterUpdate | None = None,
    mean_of_two: bool = False,
    weights_later: bool = False,
    **note: str,
) -> GlobalMetadata:
    """Publish ``state`` to ``store`` in one commit: weights (and the quantized ``update``;
    :meth:`~.exchange.Store.publish_global` sends the least the exchange needs, nothing of the
    weights when ``weights`` is false and it holds them), ledger with the node records, the
    version record (naming the ``refused`` contributions), the deletion of ``prune``. ``note``
    adds to the record's :data:`META` (``bootstrap``, ``relay``), as does the round the
    ``moments`` were sent with; ``last_update`` goes with a final global that is the mean of
    the last two (:attr:`.master.Stepped.last`), which ``mean_of_two`` says (the exchange
    may then make it from the updates, with no weights file); ``weights_later`` sends a
    weights file after the commit (:class:`~.exchange.WeightsUpload`)."""
    if moments_round is not None:
        note = {**note, "moments_round": str(moments_round)}
    return store.publish_global(
        state.global_state,
        outer_step=state.outer_step,
        ledger=state.ledger,
        prune=sorted(prune),
        metadata_extra={**META, "eta": repr(state.eta), **note},
        final=final,
        run_id=state.run_id,
        node_records=state.node_records(),
        update=update,
        refused=list(refused),
        moments=moments,
        weights=weights,
        last_update=last_update,
        mean_of_two=mean_of_two,
        weights_later=weights_later,
    )


#: How the first global of a run is published: ``(store, state, prune)``.
Bootstrap = Callable[[Store, RoundState, list[str]], None]


def publish_bootstrap(
    store: Store, state: RoundState, prune: list[str], *, weights_later: bool = False
) -> None:
    """Publish ``state`` as the first global of its run (or again over an exchange that lost
    its record), with the deletion of ``prune`` (a finished run's files); ``weights_later``:
    its weights file after the record (a run announced: its nodes hold global 0 already)."""
    first = str(state.outer_step == 0).lower()
    publish(store, state, prune=prune, weights_later=weights_later, bootstrap=first)
    _LOG.info(f"published global state at outer step {state.outer_step} (bootstrap)")


# -- agreeing with the published state -------------------------------------------------
def reconcile(
    store: Store,
    held: RoundState,
    *,
    trusted: bool,
    fresh: bool,
    new_run: Callable[[], RoundState],
    bootstrap: Bootstrap | None = None,
) -> RoundState:
    """Agree with the exchange; returns the state to hold (the exchange holds it when this
    returns, or ``bootstrap`` took its publish over; ``held``'s weights and records are never
    changed). In order:

    - a ``fresh`` master (training from step 0) over the final global of a finished run: a new
      run (``new_run()``), the old run's contributions and done records pruned;
    - nothing published: bootstrap (the held global, with a new run id when none);
    - a newer global, or no ``trusted`` local state: adopt it; an unusable one is overwritten
      with the trusted local state, or is an :class:`ExchangeError` (exit 2);
    - a ledger ahead of the weights' record (a torn publish): the held global again;
    - the published ledger merged into the held one (a lost disk never aggregates a
      contribution twice), and the node records beside it.

    A failed read raises ``TransportError`` (retried); it never leads to a bootstrap.
    """
    remote = store.global_metadata()
    state = held.copy(tensors=False)
    stale: list[str] = []
    if remote is not None and remote.final and fresh:
        _LOG.info(
            f"the exchange holds the final global of a finished run (outer step "
            f"{remote.outer_step}); starting a new run over it"
        )
        state, stale, remote = new_run(), _leftovers(store), None
    if remote is None:
        state.run_id = state.run_id or secrets.token_hex(6)
        (bootstrap or publish_bootstrap)(store, state, stale)
        return state
    book = store.read_json(GLOBAL_PROCESSED, default={})
    booked = book.get("outer_step") if isinstance(book, dict) else None
    record, adopted = remote, False
    torn = isinstance(booked, int) and booked > remote.outer_step
    if remote.outer_step > state.outer_step or not trusted or torn:
        fetched = _fetch(store, remote, state.global_state, trusted)
        if fetched is None:  # unusable: this master's own global goes over it
            remote = dataclasses.replace(remote, outer_step=-1)
        else:
            remote, weights = fetched
            if remote.outer_step > state.outer_step or not trusted:
                state.adopt(weights, remote.outer_step)
                state.run_id, adopted = remote.run_id, True
                _LOG.info(f"adopted published global at outer step {remote.outer_step}")
    if not isinstance(booked, int) or booked <= state.outer_step:
        for node, done in store.read_ledger().items():  # never a ledger ahead of the global
            state.ledger[node] = max(done, state.ledger.get(node, -1))
    if booked == state.outer_step:  # who finished, as whom: never lost with a reply
        state.take_node_records(store.read_node_records(), newer=adopted)
    if remote.outer_step < state.outer_step or remote.sha256 != record.sha256:
        publish(store, state)
    return state


Fetched = tuple[GlobalMetadata, dict[str, torch.Tensor]]


def _fetch(
    store: Store, remote: GlobalMetadata, like: Mapping[str, torch.Tensor], trusted: bool
) -> Fetched | None:
    """The published global, finite as the model's dtypes ``like``; None when it is unusable
    and the master may publish its own over it (``trusted``), else ``ExchangeError``."""
    problem = _unusable(store, remote, like)
    if not isinstance(problem, str):
        return problem
    where = f"{remote.model_file} (outer step {remote.outer_step}) of {store.repo_id!r}"
    if not trusted:
        raise ExchangeError(
            f"distributed.repo_id: the published global {where} is unusable ({problem}) and "
            "this master has no local outer state to publish over it; restore its "
            "distributed.state_dir, or delete global/ from the exchange to start a new run"
        )
    _LOG.error(
        f"the published global {where} is unusable ({problem}); publishing this master's "
        "own global over it"
    )
    return None


def _unusable(
    store: Store, remote: GlobalMetadata, like: Mapping[str, torch.Tensor]
) -> Fetched | str:
    """The global and its record, or why it cannot be used. A read that fails while the
    record stays the same is tried ``CORRUPT_READS`` times (a file read mid-write reads whole
    the next time, garbage never does); an outage, or a record that changed meanwhile,
    raises ``TransportError`` (agreed again at the next poll)."""
    failures: list[TransportError] = []

    def read() -> Fetched | str | None:
        if failures:
            again = store.global_metadata()
            if again is None or again.sha256 != remote.sha256:
                raise failures[-1]
        try:
            fetched = store.fetch_global(remote, max_bytes=max_global_bytes(like), like=like)
        except TransportError as exc:
            if exc.kind == "permanent":
                return str(exc)
            if isinstance(exc, HubUnavailable):
                raise  # an outage, not the file
            failures.append(exc)
            return (
                f"{exc}, {CORRUPT_READS} reads of the same record"
                if len(failures) == CORRUPT_READS
                else None
            )
        bad = codec.first_non_finite(fetched[1], like=like)
        return fetched if bad is None else f"{bad} is not finite as the model's {like[bad].dtype}"

    found = wait_for(read, timeout=None, interval=lambda attempt: CORRUPT_WAIT * attempt)
    assert found is not None  # no deadline, no stop: it returns a result
    return found


def _leftovers(store: Store) -> list[str]:
    """Files of a finished run: its contributions and the records of nodes that were done."""
    scan = store.scan()
    paths = [path for files in scan.deltas.values() for path in files.values()]
    for node_id in scan.owners:
        if (store.read_owner(node_id) or {}).get("state") == "done":
            paths.append(f"nodes/{node_id}/owner.json")
    return sorted(paths)


# -- the local file ----------------------------------------------------------------------
class OuterStateStore:
    """One master's files under ``state_dir``: ``outer_state.safetensors``, one atomic file
    (tensors ``global/<key>``, ``momentum/<key>``, ``residual/<key>``; the records in its
    header), and ``pending_round.json``, the write-ahead record of a round being published:
    what the master reports once it landed. A master killed between the exchange applying the
    publish and the report reports the round at its restart if the published global is that
    round's; a record of a publish that did not land is dropped (the round closes again)."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / "outer_state.safetensors"
        self.pending_path = self.state_dir / "pending_round.json"

    def load(self, like: RoundState) -> RoundState | None:
        """The saved state, shaped and typed as ``like``'s global, its momentum loaded into
        ``like``'s optimizer; None when there is none. ``ValueError`` (the file moved aside
        as ``*.corrupt-<time>``) when it cannot be read or does not match ``like``."""
        if not self.path.exists():
            return None
        try:  # one tensor at a time is read into its own buffer
            with codec.open_safetensors(self.path) as saved_file:
                meta = saved_file.metadata() or {}
                if meta.get("format") != _FORMAT:
                    raise ValueError(f"unknown format {meta.get('format')!r}")
                names = set(saved_file.keys())
                glob: dict[str, torch.Tensor] = {}
                for key, value in like.global_state.items():
                    name = f"global/{key}"
                    shape = saved_file.shape(name) if name in names else None
                    if shape is None or tuple(shape) != tuple(value.shape):
                        raise ValueError(f"global tensor {key} missing or reshaped")
                    glob[key] = saved_file.get_tensor(name).to(value.dtype)
                tensors = {
                    kind: {k[9:]: saved_file.get_tensor(k) for k in names if k.startswith(kind)}
                    for kind in ("momentum/", "residual/")
                }
            saved = RoundState(
                outer_step=int(meta["outer_step"]),
                global_state=glob,
                optimizer=like.optimizer,
                run_id=str(meta.get("run_id", "")),
                ledger=_json_map(meta["ledger"], int),
                digests=_json_map(meta["digests"], str),
                instances=_json_map(meta.get("instances", "{}"), str),  # absent before 2.2
                finals=_json_map(meta.get("finals", "{}"), int),
                dropped=_json_map(meta.get("dropped", "{}"), str),
                round_seconds=float(meta.get("round_seconds", "0")),  # absent before 2.3
                eta=float(meta.get("eta", "1.0")),
                residual=tensors["residual/"],
            )
            like.optimizer.load_state_dict(tensors["momentum/"])  # last: a failure changes nothing
        except Exception as exc:
            self.path.replace(self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}"))
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
        return saved

    def save(self, state: RoundState) -> None:
        """Write the whole state as one atomic file."""
        tensors = {f"global/{k}": v for k, v in state.global_state.items()}
        tensors.update({f"momentum/{k}": v for k, v in state.optimizer.momentum_buffers().items()})
        tensors.update({f"residual/{k}": v for k, v in state.residual.items()})
        records: dict[str, Mapping[str, object]] = {
            "ledger": state.ledger,
            "digests": state.digests,
            "instances": state.instances,
            "finals": state.finals,
            "dropped": state.dropped,
        }
        meta: dict[str, object] = {
            "format": _FORMAT,
            "outer_step": state.outer_step,
            "run_id": state.run_id,
            **{k: json.dumps(dict(sorted(v.items()))) for k, v in records.items()},
            "round_seconds": repr(float(state.round_seconds)),
            "eta": repr(float(state.eta)),
            "updated_at": datetime.now(timezone.utc).isoformat(),
        }
        atomic_write_with(
            lambda handle: codec.write_safetensors(handle, tensors, metadata=meta), self.path
        )

    def keep_global(
        self, outer_step: int, run_id: str, state: Mapping[str, torch.Tensor], keep: int
    ) -> None:
        """Keep global ``outer_step`` of ``run_id`` in float32 as ``globals/<outer_step>``
        (``distributed.final_average``), written once: a global kept stays as first written;
        globals older than the last ``keep`` go."""
        folder = self.state_dir / "globals"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{outer_step}.safetensors"
        if self._kept_run(path) != run_id:
            fp32 = {k: v.to(torch.float32) for k, v in state.items() if v.is_floating_point()}
            meta = {"outer_step": str(outer_step), "run_id": run_id}
            atomic_write_with(
                lambda handle: codec.write_safetensors(handle, fp32, metadata=meta), path
            )
        for old in folder.glob("*.safetensors"):
            if old.stem.isdigit() and int(old.stem) <= outer_step - keep:
                old.unlink(missing_ok=True)

    def kept_globals(self, run_id: str, first: int, last: int) -> list[dict[str, torch.Tensor]]:
        """The kept globals ``first`` .. ``last`` of ``run_id``, oldest first (a global not
        kept, or of another run, is left out)."""
        found = []
        for step in range(max(first, 0), last + 1):
            path = self.state_dir / "globals" / f"{step}.safetensors"
            if self._kept_run(path) == run_id:
                found.append(codec.load_safetensors(path))
        return found

    @staticmethod
    def _kept_run(path: Path) -> str | None:
        """The run of the global kept at ``path`` (None: none there, or unreadable)."""
        try:
            with codec.open_safetensors(path) as kept:
                return (kept.metadata() or {}).get("run_id")
        except (OSError, ValueError):
            return None

    def write_pending(self, outer_step: int, run_id: str, report: Mapping[str, object]) -> None:
        """Record, before publishing ``outer_step``, what the master will report about it."""
        atomic_json_dump(
            {"outer_step": outer_step, "run_id": run_id, "report": report}, self.pending_path
        )

    def clear_pending(self) -> None:
        """The round was reported (or will close again): forget its record."""
        self.pending_path.unlink(missing_ok=True)

    def take_pending(self, outer_step: int, run_id: str) -> dict[str, object] | None:
        """The report of a round published but never reported, if the global the master now
        holds is (or follows) that round's; the record is removed either way."""
        try:
            record = json.loads(self.pending_path.read_text())
        except (OSError, ValueError):
            record = None
        self.clear_pending()
        if not isinstance(record, dict) or not isinstance(record.get("report"), dict):
            return None
        step = record.get("outer_step")
        if record.get("run_id") != run_id or not isinstance(step, int) or step > outer_step:
            return None
        return cast(dict[str, object], record["report"])


def _number(value: object) -> float | None:
    """A record's number (None: absent or not one)."""
    return float(value) if isinstance(value, (int, float)) else None


def _json_map(text: str, kind: Callable[[Any], V]) -> dict[str, V]:
    """A JSON object of the header, its keys as strings and its values as ``kind``."""
    return {str(k): kind(v) for k, v in json.loads(text).items()}


#: A copy of a listed version: the local file, or why the exchange refused it.
Copy = tuple[str | None, "Path | TransportError"]


class ContributionFiles:
    """The master's contribution files. ``own`` (a store under its ``state_dir``) holds its
    own node's files (the only copy: pruned only after the publish that consumed it landed);
    ``fetched/`` holds copies of the other nodes' files, each downloaded once per listed
    version on the ``speedtronic-diloco-fetch`` thread (started when there is something to
    copy, ended when there is nothing left), so the transfers overlap the rounds instead of
    following them. ``fetched/`` is emptied at start (a restarted master reads the exchange
    again) and holds the files of the open round and of the next one, as far as sent; a
    file the exchange refused on download is refused again at the fold, without a second
    download."""

    def __init__(self, store: Store, own: Store | None, state_dir: str | os.PathLike[str]):
        self.store, self.own = store, own
        self.folder = Path(state_dir) / "fetched"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.listed: dict[str, FileInfo] = {}  # the last listing, own files included
        self.local: set[str] = set()  # the paths ``own`` holds
        self.copies: dict[str, Copy] = {}  # path -> (its listed version, the copy or refusal)
        self._cond = threading.Condition()
        self._wanted: dict[str, str | None] = {}  # path -> version to copy, in fetch order
        self._busy: str | None = None  # the path being copied now
        self._busy_released = False  # consumed or unwanted while being copied: it goes
        self._max_bytes = 0
        self._fetching = False  # a fetch thread runs and will look at ``_wanted`` again

    def scan(self) -> RepoScan:
        """The exchange's listing, with the own node's files added."""
        scan = self.store.scan()
        if self.own is not None:
            mine = self.own.scan()
            self.local = {path for files in mine.deltas.values() for path in files.values()}
            for node_id, files in mine.deltas.items():
                scan.deltas.setdefault(node_id, {}).update(files)
            scan.files.update({path: mine.files[path] for path in self.local})
        self.listed = scan.files
        return scan

    def _held(self, path: str) -> Path | TransportError | None:
        """The copy of ``path`` (or its refusal) for its listed version, if any."""
        info, held = self.listed.get(path), self.copies.get(path)
        same = held is not None and info is not None and held[0] == info.version
        return held[1] if held is not None and same else None

    def prefetch(
        self,
        candidates: Mapping[str, Mapping[int, str]],
        max_bytes: int,
        ahead: Sequence[str] = (),
    ) -> None:
        """Have every file of ``candidates`` (the open round's and older), then of ``ahead``
        (the next round's) copied here, once per listed version, on the fetch thread;
        copies of files no longer wanted go. Returns at once: an outage or a vanished file
        leaves the file to the fold, which reads the exchange itself."""
        order = [path for files in candidates.values() for path in files.values()]
        order = [p for p in dict.fromkeys([*sorted(order), *ahead]) if p not in self.local]
        with self._cond:
            self.release(set(self.copies) - set(order))
            self._wanted = {
                p: self.listed[p].version
                for p in order
                if p in self.listed and self._held(p) is None and p != self._busy
            }
            self._max_bytes = max_bytes
            if self._wanted and not self._fetching:
                self._fetching = True
                threading.Thread(
                    target=self._fetch_all, name="speedtronic-diloco-fetch", daemon=True
                ).start()
            self._cond.notify_all()

    def _fetch_all(self) -> None:
        """The fetch thread: copy the wanted files one by one until none is left."""
        while True:
            with self._cond:
                if not self._wanted:  # decided under the lock: a later prefetch starts anew
                    self._busy, self._fetching = None, False
                    self._cond.notify_all()
                    return
                path, version = next(iter(self._wanted.items()))
                del self._wanted[path]
                self._busy, self._busy_released = path, False
                max_bytes = self._max_bytes
            result = self._copy(path, version, max_bytes)
            with self._cond:
                listed, kept = self.listed.get(path), not self._busy_released
                self._busy = None
                if result is not None and kept and listed is not None and listed.version == version:
                    self.copies[path] = result
                elif result is not None and isinstance(result[1], Path):  # let go meanwhile
                    result[1].unlink(missing_ok=True)
                self._tidy()
                self._cond.notify_all()

    def _copy(self, path: str, version: str | None, max_bytes: int) -> Copy | None:
        """Download ``path`` into ``fetched/``: the copy, the exchange's refusal, or None
        (an outage, a vanished file or this disk: the fold reads the exchange)."""
        target = self.folder / path
        try:
            with self.store.local_copy(path, max_bytes=max_bytes) as source:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
            return version, target
        except TransportError as exc:
            if exc.kind == "permanent":  # refused at the fold, as it would be read there
                return version, exc
        except OSError as exc:  # this disk: the fold reads the exchange's file
            _LOG.warning(f"could not keep a copy of {path} ({exc}); read at the fold")
        except Exception as exc:  # never let the fetch thread die with files still wanted
            _LOG.warning(f"could not copy {path} ahead of the fold ({exc}); read at the fold")
        return None

    def settled(self, timeout: float | None = None) -> bool:
        """Wait until the fetch thread copied what it was asked to; False on ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._wanted and self._busy is None, timeout)

    @contextlib.contextmanager
    def open(self, path: str, max_bytes: int) -> Iterator[Path]:
        """A local file with the bytes of ``path`` (at most ``max_bytes``, checked on it): the
        own node's, the copy of its listed version (a copy under way is waited for), or one
        read from the exchange now."""
        with self._cond:
            self._wanted.pop(path, None)  # not copied yet: read below, not twice
            self._cond.wait_for(lambda: self._busy != path)
            held = self._held(path)
        if isinstance(held, TransportError):
            raise held
        if path in self.local and self.own is not None:
            source: contextlib.AbstractContextManager[Path] = self.own.local_copy(path, max_bytes)
        elif held is not None:
            if held.stat().st_size > max_bytes:
                raise too_large(path, held.stat().st_size, max_bytes)
            source = contextlib.nullcontext(held)
        else:
            source = self.store.local_copy(path, max_bytes)
        with source as local:
            yield local

    def _tidy(self) -> None:
        """Nothing held, wanted or being copied (between rounds): ``fetched/`` goes."""
        if not self.copies and not self._wanted and self._busy is None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def remote(self, paths: Iterable[str]) -> list[str]:
        """The ``paths`` the exchange holds (the rest are the own node's, on this disk)."""
        return sorted(set(paths) - self.local)

    def release(self, paths: Iterable[str]) -> None:
        """``paths`` are consumed, refused or no longer wanted: their copies go (one being
        copied goes when its copy ends), and the own node's files from this disk (the publish
        that prunes them landed)."""
        paths = set(paths)
        with self._cond:
            for path in paths:
                self._wanted.pop(path, None)
                self._busy_released |= path == self._busy
                held = self.copies.pop(path, (None, None))[1]
                if isinstance(held, Path):
                    held.unlink(missing_ok=True)
            self._tidy()
        if self.own is not None and paths & self.local:
            self.own.prune(sorted(paths & self.local))
            self.local -= paths


# -- the outer step --------------------------------------------------------------------
#: Values per slice of a tensor in the outer step (1 MiB of float32 temporaries each).
OUTER_CHUNK = 1 << 18


class NesterovOuterOptimizer:
    """The outer step of DiLoCo (Douillard et al. 2023): one ``torch.optim.SGD`` (Nesterov
    when ``momentum > 0``) made once per run over the global's floating tensors, the round's
    mean pseudo-gradient as gradient::

        buf    = momentum * buf + mean
        global = global - lr * (mean + momentum * buf)     (plain SGD when momentum == 0)

    Its parameters are named by key and share the storage of the tensors of the state each
    step is given (an adopted or loaded global replaces them); its state holds one float32
    momentum buffer per tensor. The step is torch's SGD update (what ``SGD.step`` runs) over
    slices of at most ``OUTER_CHUNK`` values, so no temporary is larger than a slice (the
    master's memory bar); a weight in another dtype is updated in float32 and rounded once.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], lr: float, momentum: float = 0.9):
        named = [
            (str(key), _bound(torch.empty(0, dtype=value.dtype), value))
            for key, value in state.items()
            if value.is_floating_point()
        ]
        if not named:
            raise ValueError("the global holds no floating tensor to optimize")
        self.momentum = float(momentum)
        self.sgd = torch.optim.SGD(
            named, lr=float(lr), momentum=self.momentum, nesterov=self.momentum > 0, foreach=False
        )
        group = self.sgd.param_groups[0]
        self.params: dict[str, torch.Tensor] = dict(
            zip(group["param_names"], group["params"], strict=True)
        )

    @property
    def lr(self) -> float:
        """The outer learning rate (the optimizer's param group's)."""
        return float(self.sgd.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        self.sgd.param_groups[0]["lr"] = float(value)

    def _pairs(
        self, state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(key, weight, grad)`` for each floating key of ``delta`` (``KeyError`` for a key
        ``state`` or the optimizer lacks, ``ValueError`` for a shape that differs)."""
        pairs = []
        for key, grad in delta.items():
            weight = state[key]
            if tuple(weight.shape) != tuple(grad.shape):
                raise ValueError(f"shape mismatch for {key}")
            if weight.is_floating_point():
                if key not in self.params:
                    raise KeyError(key)
                pairs.append((key, weight, grad))
        return pairs

    @staticmethod
    def _slices(
        weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Flat views of at most ``OUTER_CHUNK`` values of ``weight``, ``grad`` and ``buf``."""
        flat, flat_grad = weight.detach().reshape(-1), grad.detach().reshape(-1)
        flat_buf = None if buf is None else buf.reshape(-1)
        for start in range(0, max(flat.numel(), 1), OUTER_CHUNK):
            end = start + OUTER_CHUNK
            part = None if flat_buf is None else flat_buf[start:end]
            yield flat[start:end], flat_grad[start:end], part

    def _update(self, weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None) -> None:
        """The optimizer's update of one slice, in place, in float32."""
        group = self.sgd.param_groups[0]
        param = weight if weight.dtype == torch.float32 else weight.to(torch.float32)
        sgd_update(
            [param],
            [grad.to("cpu", torch.float32)],
            [buf],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            foreach=False,
        )
        if param is not weight:
            weight.copy_(param)

    def _buffer(self, key: str, *, create: bool) -> torch.Tensor | None:
        """The momentum buffer of ``key`` (None with plain SGD); ``create``: zeros when there
        is none yet (the first step's buffer is then the gradient, as torch starts it)."""
        if self.momentum == 0:
            return None
        param = self.params[key]
        buf: torch.Tensor | None = self.sgd.state[param].get("momentum_buffer")
        if buf is None and create:
            buf = torch.zeros(param.shape, dtype=torch.float32)
            self.sgd.state[param]["momentum_buffer"] = buf
        return buf

    def step(self, state: dict[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> None:
        """Apply the averaged pseudo-gradient ``delta`` to ``state`` in place, a slice at a
        time (every key checked before any is written)."""
        self._run(state, delta, trial=False)

    def first_non_finite(
        self, state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
    ) -> str | None:
        """The first key whose weight :meth:`step` would make non-finite (in its dtype), else
        None: the same update on copies of one slice at a time, changing nothing."""
        return self._run(state, delta, trial=True)

    @torch.no_grad()
    def _run(
        self, state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor], *, trial: bool
    ) -> str | None:
        for key, weight, grad in self._pairs(state, delta):
            param = self.params[key]
            if not trial:
                if param.dtype != weight.dtype:
                    raise ValueError(f"dtype of {key} changed from {param.dtype} to {weight.dtype}")
                _bound(param, weight)  # the parameter is the global's tensor
            buf = self._buffer(key, create=not trial)
            for part, grad_part, buf_part in self._slices(weight, grad, buf):
                if trial:  # as step's: the slice's update on float32 copies
                    part = part.to("cpu", torch.float32, copy=True)
                    if buf_part is not None:
                        buf_part = buf_part.clone()
                    elif self.momentum > 0:  # as step's first: zeros, of one slice here
                        buf_part = torch.zeros_like(part)
                self._update(part, grad_part, buf_part)
                if trial and not bool(torch.isfinite(part.to(weight.dtype)).all()):
                    return key
        return None

    def reset(self) -> None:
        """Forget the momentum (an adopted global starts it again from zero)."""
        self.sgd.state.clear()

    def momentum_buffers(self) -> dict[str, torch.Tensor]:
        """The momentum buffers by tensor name (the optimizer's own tensors): what the outer
        state file holds as ``momentum/<name>``."""
        buffers = {
            key: self.sgd.state.get(p, {}).get("momentum_buffer") for key, p in self.params.items()
        }
        return {key: buf for key, buf in buffers.items() if buf is not None}

    def state_dict(self) -> StateDict:
        """The optimizer's ``state_dict`` (torch's, with the tensor names in its group)."""
        return self.sgd.state_dict()

    def load_state_dict(self, saved: StateDict | Mapping[str, torch.Tensor]) -> None:
        """Replace the momentum with ``saved``'s: a :meth:`state_dict` or the buffers by tensor
        name (an outer state file), kept as float32 CPU clones; the hyperparameters stay this
        run's. ``ValueError`` for a buffer whose shape differs from its tensor's."""
        buffers = cast(Mapping[str, torch.Tensor], saved)
        if "state" in saved and "param_groups" in saved:
            torch_state = cast(StateDict, saved)
            names = [n for group in torch_state["param_groups"] for n in group["param_names"]]
            buffers = {
                names[int(i)]: entry["momentum_buffer"]
                for i, entry in torch_state["state"].items()
                if entry.get("momentum_buffer") is not None
            }
        loaded = {}
        for key, value in buffers.items():
            param = self.params.get(str(key))
            if param is None:
                continue  # a tensor this global does not have: nothing to step with it
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"momentum of {key} reshaped")
            loaded[param] = value.detach().to("cpu", torch.float32).clone()
        self.reset()
        for param, buf in loaded.items():
            self.sgd.state[param]["momentum_buffer"] = buf


def _bound(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``param`` made to share ``value``'s storage (and shape)."""
    param.set_(value.detach())  # type: ignore[call-overload]  # torch's stubs lack set_(Tensor)
    return param
