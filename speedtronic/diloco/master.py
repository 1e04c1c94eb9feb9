"""The master's round: one outer step from one contribution per node.

Round ``R`` is open while ``global/latest.safetensors`` holds outer step ``R``. Every
``poll_interval`` seconds (sooner when the local node uploaded) :meth:`RoundMaster.poll_once`
lists the repository, reads each node's status record and sorts the contribution files::

    round <= ledger[node]                       duplicate (a replay): pruned
    round <  R - max_staleness                  stale: dropped, pruned, counted
    R - max_staleness <= round <= R             included in the open round (late if < R)
    round >  R                                  early: left for its round

It closes round ``R`` when every *active* node (joined, not finished, not silent for
``drop_after`` round lengths, a drop kept across restarts) delivered its round-``R``
contribution, or ``round_timeout`` seconds after the round's first on-time contribution
arrived (a late one starts no clock); never with fewer than ``min_nodes`` contributors (less
the nodes that finished their run). Until ``expected_nodes`` nodes contributed to the run,
a round also waits for the ones still starting, up to ``drop_after`` x ``round_timeout``
after its first on-time contribution, once per run. Closing::

    mean  = sum(w_n * mean(files of n)) / sum(w_n)  # each file read once, streamed, float32
    new   = state's records, copied; new.ledger[n] = round of n's newest file   # exactly once
    SGD(nesterov).step(global, grad=mean) in place (checked finite first); new.outer_step += 1
    state = new; write-ahead record; publish weights + ledger + prune in one commit
    persist; report; hand a copy of the global to the local node; evaluate

Memory is the model's: the held global, the outer momentum and one float32 running sum; a
delta is read one tensor at a time, and the global and the local state are written to disk
one tensor at a time. The global steps in place, so a failed publish keeps the closed round
(persisted; its ledger marks the consumed files): the next poll agrees with the exchange
again (:func:`reconcile`) and publishes it, or finds that it landed. With no local state to
trust, the master takes the exchange's global back instead and the round closes anew. The
published ledger's record carries which nodes finished and as which instance, so an adopted
state knows them too; a master that finds its own run's global already final (a lost reply
to the last publish, a restart after it) finishes at once.
Every file is checked before it is used: its header names its node, round, run, instance and
base (any missing: refused and counted corrupt), it matches the model, it is finite, it is not
the node's last contribution again, and a ``weight`` other than 1 comes only from a node
listed in ``distributed.relay_leaders``. The run ends when no node is left to wait for and
the nodes finished by what the master aggregated (:class:`Roster`): then the
master publishes the final global and calls ``on_final``.

A failure the master cannot retry its way out of (an unusable global and no local state to
republish) is stored in :attr:`RoundMaster.fatal` and ends its thread; the coordinator raises
it. Transient failures are retried at every poll and logged once, then every 30 s.

Below the round, in the order it uses them: :class:`Roster` (who the round waits for),
:func:`reconcile` (agreeing with the published state), :class:`RoundState` and
:class:`OuterStateStore` (all that a round changes, and its local file with the write-ahead
record) and :class:`NesterovOuterOptimizer` (the outer step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import StateDict
from torch.optim.sgd import sgd as sgd_update

from speedtronic.checkpoint import atomic_json_dump, atomic_write_with
from speedtronic.diloco import codec as wire
from speedtronic.diloco.exchange import (
    GLOBAL_PROCESSED,
    AccessRefused,
    Emit,
    ExchangeError,
    GlobalMetadata,
    HubUnavailable,
    RemoteNotFound,
    RepoScan,
    TransportError,
    ignore,
    max_global_bytes,
    parse_delta_path,
)
from speedtronic.diloco.outer_update import OuterUpdate, state_digest, step_quantized

__all__ = [
    "IDENTITY_HEADERS",
    "META",
    "NesterovOuterOptimizer",
    "NodeView",
    "OuterStateStore",
    "Roster",
    "RoundMaster",
    "RoundState",
    "reconcile",
]

_LOG = logging.getLogger("speedtronic.diloco")


FAILURE_LOG_SECONDS = 30.0  # a failure that repeats is logged again at most this often


@dataclasses.dataclass
class _Fold:
    """What closing a round read: the files used and what they say about their nodes."""

    weight: int = 0
    included: list[str] = dataclasses.field(default_factory=list)
    consumed: list[str] = dataclasses.field(default_factory=list)
    marks: dict[str, int] = dataclasses.field(default_factory=dict)  # node -> newest round
    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    instances: dict[str, str] = dataclasses.field(default_factory=dict)
    finals: dict[str, int] = dataclasses.field(default_factory=dict)
    late: int = 0


class RoundMaster:
    """Aggregates one contribution per node per round into the published global.

    ``transport`` is the exchange (``self.store``); ``settings`` the ``distributed`` config
    section; ``state`` the model's weights (the global of a new run, and the shapes and dtypes
    every global is checked against). ``on_global(step, state)`` receives every new global
    (the local node's inbox); ``evaluate(state)`` returns an object with ``loss``,
    ``perplexity``, ``tokens`` (or None); ``on_final(step, state)`` runs once after the final
    global was published; ``upstream`` makes this master a group leader that relays its
    rounds (:mod:`speedtronic.diloco.relay`). ``emit`` reports rounds, joins, drops and
    evaluations; lines go to the ``speedtronic.diloco`` logger.

    ``last_progress`` is the ``clock()`` time (``time.monotonic`` unless a test clock is given)
    of the last sign that the run moves: the master starting, a new contribution seen on the
    exchange, a node's status record changing, a round closed. The coordinator bounds its wait
    for the final global from it (a run whose rounds are slow but moving is not stalled).
    """

    def __init__(
        self,
        transport: Any,
        state: Mapping[str, torch.Tensor],
        *,
        settings: Any,
        state_dir: str | os.PathLike,
        emit: Emit = ignore,
        on_global: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        evaluate: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        on_final: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        upstream: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = transport
        self.settings = settings
        s = settings  # the whole round state (RoundState), over this master's own copy
        self.state = RoundState.new(wire.cpu_state_dict(state), s.outer_lr, s.outer_momentum)
        # the global of a new run: the held weights until the first round (no second copy);
        # only the first agreement with the exchange may start a new run, then it is dropped
        self._initial: dict[str, torch.Tensor] | None = self.state.global_state
        self.fresh = False  # set by a master that starts its training from step 0
        self.outer_files = OuterStateStore(state_dir)
        self.has_local_state = False  # a valid local outer state: it may be republished
        self.reconciled = False
        self.exchange_created = True  # False: the startup could not create it (an outage)
        self.fatal: Exception | None = None  # an error no retry fixes; the thread stopped
        self._emit = emit
        self.roster = Roster(lambda node_id: self.store.read_owner(node_id), emit)
        self.on_global = on_global
        self.evaluate = evaluate
        self.on_final = on_final
        self.upstream = upstream  # a group leader's relay (speedtronic.diloco.relay.Upstream)
        self._clock = clock
        self._lock = threading.RLock()
        self.wake = threading.Event()
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first_arrival: float | None = None  # the open round's first on-time contribution
        self._joins_over = False  # every expected node contributed, or one round waited
        self._waiting_note: int | None = None  # the round that said it waits for nodes to start
        self._opened = clock()
        self.last_progress: float = self._opened  # see the class docstring
        self._seen: set[str] = set()  # the includable contributions of the last poll
        self._blind_since: float | None = None  # when the exchange became unreadable
        self._prune: set[str] = set()
        self._reset_tally()
        self._handed: int | None = None  # the outer step last given to on_global
        self._load_local_state()

    # -- the held state, as others read it ---------------------------------------------------
    @property
    def outer_step(self) -> int:
        """The outer step of the global this master holds (= the open round)."""
        return self.state.outer_step

    @property
    def global_state(self) -> dict[str, torch.Tensor]:
        """The global weights this master holds (do not modify)."""
        return self.state.global_state

    @property
    def ledger(self) -> dict[str, int]:
        """Node -> the highest round aggregated (or dropped as stale)."""
        return self.state.ledger

    @property
    def run_id(self) -> str:
        """The id of this run (in every global and contribution)."""
        return self.state.run_id

    @property
    def nodes(self) -> dict[str, NodeView]:
        """The nodes of this exchange, by id (see :class:`Roster`)."""
        return self.roster.nodes

    def _new_run(self) -> RoundState:
        s, initial = self.settings, self._initial
        if initial is None:  # never: only the first agreement starts a new run
            raise RuntimeError("a new run can only start when the master starts")
        return RoundState.new(wire.cpu_state_dict(initial), s.outer_lr, s.outer_momentum)

    # -- local persistence and the agreement with the exchange --------------------------------
    def _load_local_state(self) -> None:
        try:
            saved = self.outer_files.load(self.state)
        except ValueError as exc:
            _LOG.error(
                f"corrupt local outer state in {self.outer_files.state_dir} ({exc}); "
                "moved aside, rebuilding from the published global state"
            )
            return
        if saved is not None:
            self.state, self.has_local_state = saved, True

    def _persist(self) -> None:
        try:
            self.outer_files.save(self.state)
            self.has_local_state = True
        except OSError as exc:
            _LOG.warning(f"could not persist local outer state: {exc}")

    def reconcile(self) -> None:
        """Agree with the exchange once (:func:`reconcile`; a group leader
        takes the top-level global, :meth:`Upstream.agree`). A failed read raises
        ``TransportError`` (retried); an unusable global with no local state to republish
        raises ``ExchangeError``."""
        if self.upstream is not None:
            bound = max_global_bytes(self.global_state)
            state = self.upstream.agree(self.store, self.state, bound)
        else:
            state = reconcile(
                self.store,
                self.state,
                trusted=self.has_local_state,
                fresh=self.fresh,
                new_run=self._new_run,
            )
        # read before it counts as agreed: a failed read agrees again at the next poll
        over = self.upstream is None and self._published_final(state)
        with self._lock:
            self.state = state
        self.reconciled = True
        self.fresh = False  # a later reconcile (after a failed publish) is never a new run
        self._initial = None  # so the initial weights are needed no more
        self._persist()
        report = self.outer_files.take_pending(self.outer_step, self.run_id)
        if report is not None:  # published by this master, never reported (killed, or lost reply)
            self._reset_tally()
            self._emit("outer_step", **{**report, "recovered": True})
        if self._handed != self.outer_step:  # a re-reconcile after a failed publish may not move
            self._opened = self._clock()
            self._hand_over()
        if over and not self.finished.is_set():  # this run ended (a lost reply, a restart)
            self._finalize(self.global_state)

    def _published_final(self, state: RoundState) -> bool:
        """The exchange holds ``state``'s global marked final: its run is over."""
        meta = self.store.global_metadata()
        return (
            meta is not None
            and meta.final
            and meta.run_id == state.run_id
            and meta.outer_step == state.outer_step
        )

    def _hand_over(self) -> None:
        """Give the local node a copy of the new global (the held one steps in place)."""
        self._handed = self.outer_step
        if self.on_global is not None:
            self.on_global(self.outer_step, wire.cpu_state_dict(self.global_state))

    # -- one poll ---------------------------------------------------------------------------
    def _reset_tally(self) -> None:
        """Start counting the open round's refused files afresh (after a close)."""
        self._counts = {"stale": 0, "skipped": 0, "corrupt": 0}
        self._dropped: list[str] = []  # "node/round" of stale contributions since the last close
        self._refused: list[str] = []  # "node/round" of corrupt ones (the next record names them)

    def _tally(self) -> dict[str, Any]:
        """The refused files since the last close, as ``outer_step`` and ``final_global``
        report them."""
        counts = {f"deltas_{kind}": count for kind, count in self._counts.items()}
        return {**counts, "dropped": list(self._dropped), "refused": list(self._refused)}

    def poll_once(self) -> bool:
        """Scan the repository and close the open round when it is due; True if it closed."""
        now = self._clock()
        try:
            if not self.exchange_created:  # its creation failed at startup: try again
                self.store.create_repo(private=True)
                self.exchange_created = True
            if not self.reconciled:  # at start, and again after a publish that failed
                self.reconcile()
            scan = self.store.scan()
        except TransportError:
            if self._blind_since is None:
                self._blind_since = now
            raise
        self._credit_blind_time(now)
        if self.roster.refresh(scan, now, self.state):
            self.last_progress = now
        candidates = self._sort_contributions(scan, now)
        seen = {path for files in candidates.values() for path in files.values()}
        if seen - self._seen:  # a contribution not seen before
            self.last_progress = now
        self._seen = seen
        dropped = dict(self.state.dropped)
        active = self.roster.active(now, self.silence_limit, self.state)
        if self.state.dropped != dropped:  # a drop holds across a restart (RoundState)
            self._persist()
        reason = self._close_reason(now, active, candidates)
        if reason is not None and self._close(candidates, reason, active):
            return True
        if self._prune:  # refused, duplicate or stale files go now, before they are re-sent
            self._flush_prune()
        if (
            self.roster.run_over(active, self.state)
            and not candidates
            and not self.finished.is_set()
        ):
            self._finish()
        return False

    def _credit_blind_time(self, now: float) -> None:
        """While the master could not read the exchange, nobody was silent: an outage must
        not drop every node (and end the run) the moment it is over."""
        if self._blind_since is None:
            return
        blind, self._blind_since = now - self._blind_since, None
        self.roster.credit(blind)
        if self._first_arrival is not None:
            self._first_arrival += blind

    def _sort_contributions(self, scan: RepoScan, now: float) -> dict[str, dict[int, str]]:
        """Includable files ``{node: {round: path}}``; duplicates and stale ones are queued
        for pruning and counted (a stale one moves the ledger: it is never counted later)."""
        open_round = self.outer_step
        oldest = open_round - self.settings.max_staleness
        candidates: dict[str, dict[int, str]] = {}
        for node_id, files in scan.deltas.items():
            done = self.ledger.get(node_id, -1)
            for round, path in sorted(files.items()):
                if path in self._prune:
                    continue
                if round <= done:
                    self._prune.add(path)
                    self._counts["skipped"] += 1
                elif round < oldest:
                    self._prune.add(path)
                    self._counts["stale"] += 1
                    self._dropped.append(f"{node_id}/{round}")
                    with self._lock:
                        self.ledger[node_id] = max(self.ledger.get(node_id, -1), round)
                    _LOG.warning(
                        f"dropping the contribution of {node_id} to round {round}: "
                        f"{open_round - round} rounds late (max_staleness "
                        f"{self.settings.max_staleness})"
                    )
                elif round <= open_round:
                    size = scan.size(path)
                    if size is not None and size > self.max_delta_bytes:
                        self._refuse(path, f"{size} bytes, more than a delta of this model")
                        continue
                    candidates.setdefault(node_id, {})[round] = path
                    self._heard(node_id, now, on_time=round == open_round)
        return candidates

    @property
    def silence_limit(self) -> float:
        """Seconds of silence before a node is no longer waited for: ``drop_after`` round
        lengths, each at least ``round_timeout`` (the first round's wait for the nodes that
        are still starting is bounded by the same grace)."""
        return self.settings.drop_after * max(self.settings.round_timeout, self.state.round_seconds)

    @property
    def max_delta_bytes(self) -> int:
        """The largest delta file this model can produce (float32 values + a header)."""
        values = sum(v.numel() for v in self.global_state.values() if v.is_floating_point())
        return 4 * values + (1 << 20)

    def _refuse(self, path: str, why: str) -> None:
        """A contribution file that cannot be used: counted corrupt and pruned unread; the
        next published record names it (``refused``), so its node hears of it."""
        self._prune.add(path)
        self._counts["corrupt"] += 1
        parsed = parse_delta_path(path)
        if parsed is not None:
            self._refused.append(f"{parsed[0]}/{parsed[1]}")
        _LOG.warning(f"dropping delta {path}: {why}")

    def _heard(self, node_id: str, now: float, *, on_time: bool) -> None:
        """A contribution of ``node_id`` is on the exchange. The round's clock starts at its
        first on-time contribution: a late one (folded in from the last round) arrives while
        the others still train this round, and must not shorten their wait."""
        if on_time and self._first_arrival is None:
            self._first_arrival = now
        self.roster.heard(node_id, now, self.state)

    def _close_reason(
        self, now: float, active: set[str], candidates: Mapping[str, Mapping[int, str]]
    ) -> str | None:
        if not candidates:
            return None
        # min_nodes is a floor on the nodes in a round, lowered only by nodes that finished
        need = max(1, self.settings.min_nodes - self.roster.finished_count(self.state))
        if len(candidates) < need:
            return None
        on_time = {node for node, files in candidates.items() if self.outer_step in files}
        starting = self._starting(candidates)
        if active <= on_time and not (starting and active):
            return "complete" if active else "drain"
        waited = now - (self._first_arrival if self._first_arrival is not None else now)
        if waited < (self.silence_limit if starting else self.settings.round_timeout):
            return None
        if starting:
            self._stop_expecting(starting, waited)
        return "timeout"

    def _starting(self, candidates: Mapping[str, Mapping[int, str]]) -> int:
        """How many of the ``distributed.expected_nodes`` have not contributed to this run
        yet (they are still starting, announced or not). The round waits for them, and for
        the active nodes, up to :attr:`silence_limit` after its first on-time contribution
        instead of ``round_timeout``: a slow start is not a slow round. Once per run: when
        they all contributed, or when one round waited for them (:meth:`_stop_expecting`)."""
        expected = self.settings.expected_nodes
        if self._joins_over or expected <= 0:
            return 0
        started = len(set(self.ledger) | set(candidates))
        if started >= expected:
            self._joins_over = True
            _LOG.info(f"all {expected} expected nodes (distributed.expected_nodes) contributed")
            return 0
        if self._waiting_note != self.outer_step:
            self._waiting_note = self.outer_step
            _LOG.info(
                f"round {self.outer_step} waits for {expected - started} more node(s) to start "
                f"and contribute (distributed.expected_nodes={expected}; at most "
                f"{self.silence_limit:.0f} s after the round's first contribution)"
            )
        return expected - started

    def _stop_expecting(self, starting: int, waited: float) -> None:
        """The round waited its bound for the expected nodes that did not contribute: they
        are waited for no more (a node that starts later joins when it announces itself)."""
        self._joins_over = True
        expected = self.settings.expected_nodes
        _LOG.warning(
            f"round {self.outer_step} closes without {starting} of the {expected} expected "
            f"nodes (distributed.expected_nodes): nothing from them {waited:.0f} s after the "
            "round's first contribution (distributed.drop_after x round_timeout); no longer "
            "waiting for them (a node that starts later joins when it announces itself)"
        )
        self._emit("nodes_missing", outer_step=self.outer_step, expected=expected, missing=starting)

    # -- closing a round -----------------------------------------------------------------------
    def _close(
        self, candidates: Mapping[str, Mapping[int, str]], reason: str, active: set[str]
    ) -> bool:
        started = time.perf_counter()
        total = {  # the round's one float32 running sum
            k: torch.zeros(tuple(v.shape), dtype=torch.float32)
            for k, v in self.global_state.items()
            if v.is_floating_point()
        }
        fold = _Fold()
        for node_id in sorted(candidates):
            self._fold_node(node_id, candidates[node_id], total, fold)
            wire.return_free_memory()  # the file's temporaries, before the next file's
        if not fold.marks:
            return False
        for value in total.values():
            value.div_(float(fold.weight))
        old, new = self.state, self.state.copy(tensors=False)  # the weights step in place
        round = new.outer_step
        for node_id, newest in fold.marks.items():
            new.ledger[node_id] = max(new.ledger.get(node_id, -1), newest)
            new.finals.pop(node_id, None)  # a node that contributes again is not done yet
        new.digests.update(fold.digests)
        new.instances.update(fold.instances)
        new.finals.update(fold.finals)
        final = self.roster.run_over(self.roster.waiting(new), new)
        if not self._step(new, total, fold.weight, final):
            for path in fold.consumed:
                self._refuse(path, "the outer step would make the global non-finite")
            return False
        del total
        report = {
            "outer_step": new.outer_step,
            "round": round,
            "reason": reason,
            "nodes_active": len(active),
            "nodes_included": len(fold.marks),
            "deltas_found": len(fold.consumed) + self._counts["corrupt"],
            "deltas_included": len(fold.consumed),
            "deltas_late": fold.late,
            "included": fold.included,
            **self._tally(),
        }
        # written ahead: a kill after the exchange applied the publish and before the round
        # is reported below leaves this record, reported at the restart (OuterStateStore)
        self.outer_files.write_pending(new.outer_step, new.run_id, report)
        update, new.update = new.update, None  # published once: a republish sends the global
        with self._lock:
            self.state = new
        try:
            self.store.publish_global(
                new.global_state,
                outer_step=new.outer_step,
                ledger=new.ledger,
                prune=sorted(set(fold.consumed) | self._prune),
                metadata_extra=META,
                final=final,
                run_id=new.run_id,
                node_records=new.node_records(),
                **({"update": update} if update is not None else {}),
                **({"refused": report["refused"]} if report["refused"] else {}),
            )
        except Exception:
            # It may still have landed: the next poll agrees with the exchange again. The
            # closed round is kept (its ledger marks the consumed files, so nothing is counted
            # twice; a group leader's mean is at the top level already) and published again
            # from the local state; with no local state to trust, the exchange's global is
            # taken again instead and the round closes anew from the files still there.
            self._persist()
            if self.has_local_state:
                self._prune.update(fold.consumed)  # consumed: they go with the next commit
                self._first_arrival = None
            elif self.upstream is None:
                with self._lock:
                    self.state = old  # its weights are replaced when the global is adopted
            self.reconciled = False
            raise
        opened, self._opened = self._opened, self._clock()
        self.last_progress = self._opened
        length = self._opened - opened
        average = new.round_seconds  # kept in the state: a restart drops nobody too soon
        new.round_seconds = length if not average else (0.7 * average + 0.3 * length)
        self._prune.clear()
        self._persist()
        wire.return_free_memory()
        self._first_arrival = None
        self._reset_tally()
        self._emit(
            "outer_step", **report, seconds=time.perf_counter() - started, round_seconds=length
        )
        self.outer_files.clear_pending()
        self._after_publish(final)
        return True

    def _step(
        self, new: RoundState, mean: dict[str, torch.Tensor], weight: int, final: bool
    ) -> bool:
        """The outer step on ``new``; a group leader relays the round's ``mean`` up instead
        and takes the top-level global that includes it. False when the result would not be
        finite (``new`` is then discarded)."""
        if self.upstream is not None:  # the wait for the top level may be long: no lock held
            meta, weights = self.upstream.forward(
                mean, round=new.outer_step, weight=weight, run_id=new.run_id, final=final
            )
            new.adopt(weights, meta.outer_step)
            new.run_id = meta.run_id
            return True
        if new.optimizer.first_non_finite(new.global_state, mean) is not None:
            return False  # checked on temporaries: nothing changed
        s = self.settings
        if s.global_dtype == "fp32":
            new.optimizer.step(new.global_state, mean)
            new.outer_step += 1
            return True
        # the global becomes the last one + the decoded quantized update (docs/diloco.md)
        update = step_quantized(
            new.optimizer,
            new.global_state,
            mean,
            new.residual,
            dtype=s.global_dtype,
            block_size=s.delta_block_size,
            error_feedback=s.error_feedback,
        )
        update.base_step, update.run_id = new.outer_step, new.run_id
        new.outer_step += 1
        update.outer_step = new.outer_step
        update.digest = state_digest(new.global_state)
        new.update = update
        return True

    def _fold_node(
        self, node_id: str, files: Mapping[int, str], total: dict[str, torch.Tensor], fold: _Fold
    ) -> None:
        """Add one node's valid files for this round into ``total`` as their mean times the
        node's weight (1, or the nodes a relay leader speaks for), reading each file once,
        tensor by tensor, and record them in ``fold``. Unusable files are pruned and counted,
        and leave ``total`` untouched."""
        with contextlib.ExitStack() as stack:
            readers: list[tuple[int, str, wire.DeltaReader, int]] = []
            for round, path in sorted(files.items()):
                try:
                    bound = self.max_delta_bytes  # checked on the file actually opened
                    local = stack.enter_context(self.store.local_copy(path, max_bytes=bound))
                    reader = stack.enter_context(wire.open_delta(local))
                    header = reader.metadata
                    leaders = self.settings.relay_leaders
                    weight = self.roster.check_identity(
                        node_id, header, round, self.outer_step, leaders
                    )
                    digest = reader.check(self.global_state)
                    if self.state.digests.get(node_id) == digest:
                        raise ValueError("the same values as its node's last contribution")
                except RemoteNotFound:
                    continue
                except TransportError as exc:
                    if exc.kind != "permanent":
                        raise  # an outage: the whole round is retried at the next poll
                    self._refuse(path, str(exc))  # too large, a link: never usable
                    continue
                except Exception as exc:
                    self._refuse(path, f"{type(exc).__name__}: {exc}")
                    continue
                run = reader.metadata["run_id"]
                if run and self.run_id and run != self.run_id:  # computed in another run
                    self._prune.add(path)
                    self._counts["stale"] += 1
                    self._dropped.append(f"{node_id}/{round}")
                    _LOG.warning(f"dropping {path}: it belongs to another run ({run})")
                    continue
                readers.append((round, path, reader, weight))
                fold.digests[node_id] = digest
                fold.instances[node_id] = reader.metadata["instance"]
                if reader.metadata.get("final") == "true":
                    fold.finals[node_id] = round
            if not readers:
                return
            weight = max(w for _, _, _, w in readers)
            for _, _, reader, _ in readers:
                reader.add_to(total, scale=weight / len(readers))
        fold.weight += weight
        for round, path, _, _ in readers:
            fold.included.append(f"{node_id}/{round}")
            fold.consumed.append(path)
            fold.late += round < self.outer_step
            fold.marks[node_id] = max(fold.marks.get(node_id, -1), round)

    def _after_publish(self, final: bool) -> None:
        self._hand_over()
        state = self.global_state  # read while the master thread does nothing else
        if self.evaluate is not None:
            result = self.evaluate(state)
            if result is not None:
                self._emit(
                    "eval",
                    scope="global",
                    outer_step=self.outer_step,
                    step=self.outer_step * self.settings.inner_steps,
                    loss=result.loss,
                    perplexity=result.perplexity,
                    tokens=result.tokens,
                )
        if final:
            self._finalize(state)

    def _flush_prune(self) -> None:
        try:
            self.store.prune(sorted(self._prune))
            self._prune.clear()
        except TransportError as exc:
            _LOG.warning(f"could not prune consumed deltas: {exc}")

    def _finish(self) -> None:
        """Every node is done and nothing is left: mark the published global final (a group
        leader first tells the top level that its group is done)."""
        if self.upstream is not None:
            self.upstream.finish()
        state = self.state
        self.store.publish_global(
            state.global_state,
            outer_step=state.outer_step,
            ledger=state.ledger,
            metadata_extra=META,
            final=True,
            run_id=state.run_id,
            node_records=state.node_records(),
            **({"refused": list(self._refused)} if self._refused else {}),
        )
        # files refused after the last round (e.g. written once every node was done) are
        # reported here, or they would never be counted
        self._emit("final_global", outer_step=state.outer_step, **self._tally())
        self._reset_tally()
        self._finalize(state.global_state)

    def _finalize(self, state: dict[str, torch.Tensor]) -> None:
        if self.on_final is not None:
            self.on_final(self.outer_step, state)
        _LOG.info(f"final global published at outer step {self.outer_step}")
        self.finished.set()

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Run :meth:`poll_once` on a daemon thread until stopped, finished or fatal."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self.last_progress = self._clock()
        self._thread = threading.Thread(
            target=self._loop, name="speedtronic-diloco-master", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        trouble = _Trouble()
        while not self._stop.is_set() and not self.finished.is_set():
            try:
                closed = self.poll_once()
            except (ExchangeError, AccessRefused) as exc:  # no retry fixes it: the
                # coordinator raises it on the training thread (exit 2)
                _LOG.error(str(exc))
                self.fatal = exc
                return
            except TransportError as exc:
                trouble.failed("warning", exc)
                closed = False
            except Exception as exc:  # never let the aggregation thread die silently
                trouble.failed("error", exc)
                closed = False
            else:
                trouble.recovered()
            if not closed:
                self.wake.wait(self.settings.poll_interval)
                self.wake.clear()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (bounded join); state is persisted after every round."""
        self._stop.set()
        self.wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def state_dict(self) -> dict[str, Any]:
        """Outer step and ledger (the tensors live in ``state_dir`` and the repository)."""
        with self._lock:
            return {"outer_step": self.outer_step, "ledger": dict(self.ledger)}


class _Trouble:
    """The master loop's failures: the first of a kind is logged, then while the same kind
    (exception class) repeats, one line per ``FAILURE_LOG_SECONDS`` saying for how long."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._kind: str | None = None
        self._since = self._said = 0.0

    def failed(self, level: str, exc: BaseException) -> None:
        now, kind = self._clock(), type(exc).__name__
        line = getattr(_LOG, level)
        if kind != self._kind:
            self._kind, self._since, self._said = kind, now, now
            line(f"master round failed ({kind}); retrying at every poll: {exc}")
        elif now - self._said >= FAILURE_LOG_SECONDS:
            self._said = now
            line(f"master round still failing after {now - self._since:.0f} s ({kind}): {exc}")

    def recovered(self) -> None:
        if self._kind is not None:
            _LOG.info(f"master round works again after {self._clock() - self._since:.0f} s")
            self._kind = None


# -- who the round waits for -----------------------------------------------------------
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
    """Who the round waits for: one :class:`NodeView` per node of the exchange, from its
    status record (``nodes/<id>/owner.json``: instance, ``state`` training | done |
    aggregator, ``final_round`` when done; ``read_owner`` of the store), rebuilt from the
    exchange after a restart. A record is read again only when the listing shows a new version
    of it, so a poll costs one listing however many nodes there are. ``emit`` reports joins,
    drops and rejoins.

    A status record is a claim, never proof (anyone who can write to the exchange can write
    one): a node finished its run only by what the master aggregated, see :meth:`finished`.
    """

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

    def refresh(self, scan: RepoScan, now: float, state: RoundState) -> bool:
        """Update every node from its status record (a restarted node is a new view); True
        when a record is new or changed since the last refresh (a sign of progress). An
        instance that ``state`` lists as dropped (a restarted master) stays dropped."""
        changed = False
        for node_id in sorted(scan.owners):
            view = self.nodes.get(node_id)
            before = self._records.get(node_id)
            record = self._record(node_id, scan)
            changed |= before is None or before[1] != record
            instance = record.get("instance")
            if view is None or (instance and instance != view.instance):
                dropped = bool(instance) and state.dropped.get(node_id) == instance
                if instance and not dropped:  # a new instance of a dropped node: waited for
                    state.dropped.pop(node_id, None)
                view = NodeView(node_id, instance=instance, last_heard=now, dropped=dropped)
                self.nodes[node_id] = view
                if dropped:
                    _LOG.info(
                        f"node {node_id} stays dropped (it was before this master restarted); "
                        "it rejoins when it delivers"
                    )
                elif record.get("state", "training") == "training":
                    self._emit("node_joined", node_id=node_id, outer_step=state.outer_step)
            status = str(record.get("state", view.state))
            if view.state == "done" and status == "training":
                view.last_heard = now  # restarted after it had finished: waiting again
            view.state = status
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

    def heard(self, node_id: str, now: float, state: RoundState) -> None:
        """A contribution of ``node_id`` arrived: it is not silent (a dropped node rejoins
        and leaves ``state.dropped``)."""
        view = self.nodes.get(node_id)
        if view is None:  # contributions without a status record are used, never waited for
            return
        if view.dropped:
            view.dropped = False
            state.dropped.pop(node_id, None)
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
        dropped (logged and reported once, recorded in ``state.dropped``) until it delivers
        again."""
        active = set()
        for view in self.nodes.values():
            if not self._expected(view, state):
                continue
            silent = now - view.last_heard
            if silent > limit and not view.dropped:
                view.dropped = True
                state.dropped[view.node_id] = view.instance or ""
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


# -- agreeing with the published state -------------------------------------------------
META = {"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd"}
CORRUPT_READS = 3  # reads of an unchanged record before its weights count as unusable
CORRUPT_WAIT = 0.2  # seconds before the second read (then twice that)


def reconcile(
    store: Any,
    held: RoundState,
    *,
    trusted: bool,
    fresh: bool,
    new_run: Callable[[], RoundState],
) -> RoundState:
    """Agree with the exchange ``store``, at start and after a failed publish; returns the
    state to hold from now on (the exchange holds it when this returns; ``held``'s weights and
    records are never changed; an adopted global resets the run's one outer optimizer, which
    ``held`` shares, and any retry adopts it again). The cases, in order:

    - a ``fresh`` master (training from step 0) over the final global of a finished run: a new
      run from the initial weights, the old run's contributions and done records pruned;
    - nothing published: bootstrap (publish the held global, with a new run id when none);
    - a newer published global, or no trusted local state: adopt it (finite as the model's
      dtypes); an unusable one (corrupt, non-finite, too large) is overwritten with the local
      state, or is an :class:`ExchangeError` (exit 2) when there is none: never a loop;
    - a ledger ahead of the weights' record (a publish torn between its files): the weights'
      own header says which step they hold, and the held global is published again;
    - the published ledger is merged into the held one (a lost disk never aggregates a
      contribution twice), and with an adopted global the node records beside it (who
      finished, as which instance: a lost reply or a restart never waits for nodes that are
      done).

    ``trusted``: ``held`` was read from (or saved to) the master's own valid local state and
    may be republished; ``fresh``: the master starts training from step 0; ``new_run()``: the
    state of a new run. A failed read raises ``TransportError`` (the caller retries); it never
    leads to a bootstrap that could overwrite a live global.
    """
    remote = store.global_metadata()
    state = held.copy(tensors=False)
    stale: list[str] = []
    if remote is not None and remote.final and fresh:
        _LOG.info(
            f"the exchange holds the final global of a finished run (outer step "
            f"{remote.outer_step}); starting a new run over it"
        )
        state = new_run()
        stale = _leftovers(store)
        remote = None
    if remote is None:
        state.run_id = state.run_id or secrets.token_hex(6)
        store.publish_global(
            state.global_state,
            outer_step=state.outer_step,
            ledger=state.ledger,
            prune=stale,
            metadata_extra={**META, "bootstrap": str(state.outer_step == 0).lower()},
            run_id=state.run_id,
            node_records=state.node_records(),
        )
        _LOG.info(f"published global state at outer step {state.outer_step} (bootstrap)")
        return state
    book = store.read_json(GLOBAL_PROCESSED, default={})
    booked = book.get("outer_step") if isinstance(book, dict) else None
    record = remote
    adopted = False
    # the ledger ahead of the record: a publish torn between its files; the weights' own
    # header says which outer step they hold
    torn = isinstance(booked, int) and booked > remote.outer_step
    if remote.outer_step > state.outer_step or not trusted or torn:
        fetched = _fetch(store, remote, state.global_state, trusted)
        if fetched is None:  # unusable: this master's own global goes over it
            remote = dataclasses.replace(remote, outer_step=-1)
        else:
            remote, weights = fetched
            if remote.outer_step > state.outer_step or not trusted:
                state.adopt(weights, remote.outer_step)
                state.run_id = remote.run_id
                adopted = True
                _LOG.info(f"adopted published global at outer step {remote.outer_step}")
    if not isinstance(booked, int) or booked <= state.outer_step:
        for node, done in store.read_ledger().items():  # never a ledger ahead of the global
            state.ledger[node] = max(done, state.ledger.get(node, -1))
    if booked == state.outer_step:  # who finished, as whom: never lost with a reply
        state.take_node_records(store.read_node_records(), newer=adopted)
    repaired = remote.sha256 != record.sha256
    if remote.outer_step < state.outer_step or repaired:
        store.publish_global(
            state.global_state,
            outer_step=state.outer_step,
            ledger=state.ledger,
            metadata_extra=META,
            run_id=state.run_id,
            node_records=state.node_records(),
        )
    return state


def _fetch(
    store: Any,
    remote: GlobalMetadata,
    like: Mapping[str, torch.Tensor],
    trusted: bool,
) -> tuple[GlobalMetadata, dict[str, torch.Tensor]] | None:
    """The published global, finite as the model's dtypes ``like``; None when it is unusable
    and the master may republish its own (``trusted``), else ``ExchangeError``."""
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
    store: Any, remote: GlobalMetadata, like: Mapping[str, torch.Tensor]
) -> tuple[GlobalMetadata, dict[str, torch.Tensor]] | str:
    """The global and its record, or why it cannot be used. A read that fails while the
    record stays the same is tried ``CORRUPT_READS`` times: a file read mid-write (or a
    truncated reply) reads whole the next time, garbage never does. An outage (the record
    cannot be read) raises ``TransportError``: retried at the next poll."""
    for attempt in range(1, CORRUPT_READS + 1):
        try:
            fetched, weights = store.fetch_global(
                remote, max_bytes=max_global_bytes(like), like=like
            )
        except TransportError as exc:
            if exc.kind == "permanent":
                return str(exc)
            if isinstance(exc, HubUnavailable):
                raise  # an outage, not the file: retried at the next poll
            if attempt == CORRUPT_READS:
                return f"{exc}, {CORRUPT_READS} reads of the same record"
            time.sleep(CORRUPT_WAIT * attempt)
            again = store.global_metadata()
            if again is None or again.sha256 != remote.sha256:
                raise  # the exchange changed meanwhile: agree again at the next poll
            continue
        bad = wire.first_non_finite(weights, like=like)
        if bad is None:
            return fetched, weights
        return f"{bad} is not finite as the model's {like[bad].dtype}"
    raise AssertionError("unreachable")


def _leftovers(store: Any) -> list[str]:
    """Files of a finished run: its contributions and the records of nodes that were done."""
    scan = store.scan()
    paths = [path for files in scan.deltas.values() for path in files.values()]
    for node_id in scan.owners:
        if (store.read_owner(node_id) or {}).get("state") == "done":
            paths.append(f"nodes/{node_id}/owner.json")
    return sorted(paths)


# -- the round state and its local file ------------------------------------------------
_FORMAT = "speedtronic-outer-state/2"


@dataclass
class RoundState:
    """The master's whole mutable round state (one object: copy it, change the copy, keep it
    once the exchange holds it).

    ``outer_step``: the published global's outer step (= the open round); ``global_state``:
    its weights in the model's dtypes; ``optimizer``: the outer optimizer and its momentum;
    ``run_id``: names the run; ``ledger``: node -> highest round aggregated (or dropped);
    ``digests``: node -> sha256 of its last aggregated contribution (a re-sent copy is refused);
    ``instances``: node -> the ``instance`` header of its last aggregated contribution;
    ``finals``: node -> the round of its aggregated contribution flagged ``final``;
    ``dropped``: node -> the instance the master stopped waiting for (silent for ``drop_after``
    round lengths; it stays dropped across a restart until that instance delivers, and a new
    instance of the node is waited for again);
    ``round_seconds``: a moving average of the round lengths (the master's drop limit counts
    in it, so it survives a restart); ``residual``: what the quantized outer updates left out
    (``global_dtype`` int8/int4 with error feedback); ``update``: the quantized update of the
    outer step just taken, until it is published (never saved: a republish sends the full
    global only).
    """

    outer_step: int
    global_state: dict[str, torch.Tensor]
    optimizer: NesterovOuterOptimizer
    run_id: str = ""
    ledger: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)
    finals: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    round_seconds: float = 0.0
    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    update: OuterUpdate | None = field(default=None, repr=False, compare=False)

    @classmethod
    def new(cls, global_state: dict[str, torch.Tensor], lr: float, momentum: float) -> RoundState:
        """Outer step 0 of a new run over ``global_state`` (kept, not copied)."""
        return cls(0, global_state, NesterovOuterOptimizer(global_state, lr, momentum))

    def copy(self, *, tensors: bool = True) -> RoundState:
        """A copy with new records over the run's one outer optimizer (shared: it is made
        once per run): its weights and residual cloned, or with ``tensors=False`` a new
        weights dict over the same tensors (what a reconcile changes: it replaces tensors,
        never writes into them)."""
        optimizer = self.optimizer
        weights = wire.cpu_state_dict(self.global_state) if tensors else dict(self.global_state)
        return RoundState(
            self.outer_step,
            weights,
            optimizer,
            self.run_id,
            dict(self.ledger),
            dict(self.digests),
            dict(self.instances),
            dict(self.finals),
            dict(self.dropped),
            self.round_seconds,
            wire.cpu_state_dict(self.residual) if tensors else self.residual,
        )

    def node_records(self) -> dict[str, dict[str, Any]]:
        """What the published ledger's record carries of each node beside its round (the
        transport's ``NODE_RECORDS``): a master that adopts the published global from it
        knows which nodes finished, which instance they ran as and which it stopped waiting
        for."""
        return {
            "finals": dict(self.finals),
            "instances": dict(self.instances),
            "digests": dict(self.digests),
            "dropped": dict(self.dropped),
        }

    def take_node_records(self, records: Mapping[str, Mapping[str, Any]], *, newer: bool) -> None:
        """Merge published ``records`` (see :meth:`node_records`): they replace this state's
        when ``newer`` (the published global was adopted), else they only fill what it lacks
        (an outer state file written before they were kept)."""
        for name, mine in self.node_records().items():
            published = dict(records.get(name) or {})
            merged = {**mine, **published} if newer else {**published, **mine}
            setattr(self, name, merged)

    def adopt(self, state: Mapping[str, torch.Tensor], outer_step: int) -> None:
        """Take a published global (cast to this state's dtypes; other keys and shapes are
        ignored) at ``outer_step``; the momentum starts again from zero (the run's outer
        optimizer, shared with the state this one was copied from, forgets it)."""
        for key, value in state.items():
            mine = self.global_state.get(key)
            if mine is not None and tuple(value.shape) == tuple(mine.shape):
                self.global_state[key] = wire.cpu_tensor(value).to(mine.dtype)
        self.outer_step = int(outer_step)
        self.optimizer.reset()


class OuterStateStore:
    """One master's files under ``state_dir``.

    ``outer_state.safetensors`` is one atomic file: tensors ``global/<key>`` and
    ``momentum/<key>``; its header the outer step, run id, ledger, digests, the nodes'
    instances, final rounds and drops, and the average round length (a kill leaves the old or
    the new state). ``pending_round.json`` is the write-ahead record of a round being
    published: what the master will report once the publish landed. A master killed between
    the exchange applying the publish and the report finds it at its restart and reports the
    round then, if the published global is that round's; a record of a publish that did not
    land is dropped (its contributions are still on the exchange, and the round closes again).
    """

    def __init__(self, state_dir: str | os.PathLike):
        self.state_dir = Path(state_dir)

    @property
    def path(self) -> Path:
        """The outer state file."""
        return self.state_dir / "outer_state.safetensors"

    @property
    def pending_path(self) -> Path:
        """The write-ahead record of a round being published."""
        return self.state_dir / "pending_round.json"

    def load(self, like: RoundState) -> RoundState | None:
        """The saved state, its tensors shaped and typed as ``like``'s global, its momentum
        loaded into ``like``'s outer optimizer (the run's one); None when there is none.

        Raises ``ValueError`` (after moving the file aside as ``*.corrupt-<time>``) when the
        file cannot be read or does not match ``like``."""
        if not self.path.exists():
            return None
        try:  # one tensor at a time is read into its own buffer
            with wire.open_safetensors(self.path) as saved_file:
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
                momentum = {  # by tensor name: the optimizer's state (also a 2.1 file's)
                    k[9:]: saved_file.get_tensor(k) for k in names if k.startswith("momentum/")
                }
                residual = {
                    k[9:]: saved_file.get_tensor(k) for k in names if k.startswith("residual/")
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
                dropped=_json_map(meta.get("dropped", "{}"), str),  # absent in older files
                round_seconds=float(meta.get("round_seconds", "0")),  # absent before 2.3
                residual=residual,
            )
            like.optimizer.load_state_dict(momentum)  # last: a failed read leaves it as it was
        except Exception as exc:
            self.path.replace(self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}"))
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
        return saved

    def save(self, state: RoundState) -> None:
        """Write the whole state as one atomic file."""
        tensors = {f"global/{k}": v for k, v in state.global_state.items()}
        momentum = state.optimizer.momentum_buffers()  # the optimizer's state, by tensor name
        tensors.update({f"momentum/{k}": v for k, v in momentum.items()})
        tensors.update({f"residual/{k}": v for k, v in state.residual.items()})
        meta = {
            "format": _FORMAT,
            "outer_step": state.outer_step,
            "run_id": state.run_id,
            "ledger": json.dumps(dict(sorted(state.ledger.items()))),
            "digests": json.dumps(dict(sorted(state.digests.items()))),
            "instances": json.dumps(dict(sorted(state.instances.items()))),
            "finals": json.dumps(dict(sorted(state.finals.items()))),
            "dropped": json.dumps(dict(sorted(state.dropped.items()))),
            "round_seconds": repr(float(state.round_seconds)),
            "updated_at": datetime.now(timezone.utc).isoformat(),
        }
        atomic_write_with(
            lambda handle: wire.write_safetensors(handle, tensors, metadata=meta), self.path
        )

    def write_pending(self, outer_step: int, run_id: str, report: dict[str, Any]) -> None:
        """Record, before publishing ``outer_step``, what the master will report about it."""
        atomic_json_dump(
            {"outer_step": outer_step, "run_id": run_id, "report": report}, self.pending_path
        )

    def clear_pending(self) -> None:
        """The round was reported (or will close again): forget its record."""
        self.pending_path.unlink(missing_ok=True)

    def take_pending(self, outer_step: int, run_id: str) -> dict[str, Any] | None:
        """The report of a round that was published but never reported, given the global the
        master now holds; None when there is none or its publish did not land. The record is
        removed either way."""
        try:
            record = json.loads(self.pending_path.read_text())
        except (OSError, ValueError):
            record = None
        self.clear_pending()
        if not isinstance(record, dict) or not isinstance(record.get("report"), dict):
            return None
        landed = record.get("run_id") == run_id and isinstance(record.get("outer_step"), int)
        if not landed or record["outer_step"] > outer_step:
            return None
        return record["report"]


def _json_map(text: str, kind: Callable[[Any], Any]) -> dict[str, Any]:
    """A JSON object of the header, its keys as strings and its values as ``kind``."""
    return {str(k): kind(v) for k, v in json.loads(text).items()}


# -- the outer step --------------------------------------------------------------------
#: Values per slice of a tensor in the outer step (1 MiB of float32 temporaries each).
OUTER_CHUNK = 1 << 18


class NesterovOuterOptimizer:
    """The outer step of DiLoCo (Douillard et al. 2023, Algorithm 1): one ``torch.optim.SGD``
    (Nesterov when ``momentum > 0``, ``foreach=False``) made once per run over the global's
    floating tensors, with the round's mean pseudo-gradient as gradient::

        buf    = momentum * buf + mean
        global = global - lr * (mean + momentum * buf)     (plain SGD when momentum == 0)

    Its parameters are leaf tensors named by key that share the storage of the global's
    tensors (rebound to the tensors of the state each step is given: an adopted or loaded
    global replaces them); its state holds one float32 momentum buffer per tensor. The step
    is torch's SGD update (``torch.optim.sgd.sgd``, what ``SGD.step`` runs) over slices of
    at most ``OUTER_CHUNK`` values of the parameter, its gradient and its buffer, so no
    temporary is larger than a slice however large one tensor is (the master's memory bar).
    A weight in another dtype is updated in float32 and rounded once.

    ``lr`` is the outer learning rate (DiLoCo's 0.7), ``momentum`` its Nesterov momentum (0.9;
    0 is plain SGD). ``step(state, delta)`` updates ``state`` in place.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], lr: float, momentum: float = 0.9):
        named = []
        for key, value in state.items():
            if value.is_floating_point():
                param = torch.empty(0, dtype=value.dtype)
                named.append((str(key), param.set_(value.detach())))
        if not named:
            raise ValueError("the global holds no floating tensor to optimize")
        momentum = float(momentum)
        self.sgd = torch.optim.SGD(
            named, lr=float(lr), momentum=momentum, nesterov=momentum > 0, foreach=False
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

    @property
    def momentum(self) -> float:
        """The Nesterov momentum (0: plain SGD)."""
        return float(self.sgd.param_groups[0]["momentum"])

    def _pairs(
        self, state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(key, weight, grad)`` for each floating key of ``delta`` (``KeyError`` for a key
        ``state`` or the optimizer lacks, ``ValueError`` for a shape that differs)."""
        for key, grad in delta.items():
            if key not in state:
                raise KeyError(key)
            weight = state[key]
            if tuple(weight.shape) != tuple(grad.shape):
                raise ValueError(f"shape mismatch for {key}")
            if weight.is_floating_point():
                if key not in self.params:
                    raise KeyError(key)
                yield key, weight, grad

    def _slices(
        self, weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Flat views of at most ``OUTER_CHUNK`` values of ``weight``, ``grad`` and ``buf``."""
        flat = weight.detach().reshape(-1)
        flat_grad = grad.detach().reshape(-1)
        flat_buf = None if buf is None else buf.reshape(-1)
        for start in range(0, max(flat.numel(), 1), OUTER_CHUNK):
            end = start + OUTER_CHUNK
            part = None if flat_buf is None else flat_buf[start:end]
            yield flat[start:end], flat_grad[start:end], part

    def _update(self, weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None) -> None:
        """The optimizer's update of one slice, in place (float32 arithmetic; a weight in
        another dtype is updated on a float32 copy and rounded once)."""
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
        buf = self.sgd.state[param].get("momentum_buffer")
        if buf is None and create:
            buf = torch.zeros(param.shape, dtype=torch.float32)
            self.sgd.state[param]["momentum_buffer"] = buf
        return buf

    @torch.no_grad()
    def step(self, state: dict[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> None:
        """Apply the averaged pseudo-gradient ``delta`` to ``state`` in place: the optimizer's
        parameters are bound to ``state``'s tensors and stepped a slice at a time (float32
        temporaries of one slice at most)."""
        pairs = list(self._pairs(state, delta))  # every key checked before any is written
        for key, weight, grad in pairs:
            param = self.params[key]
            if param.dtype != weight.dtype:
                raise ValueError(f"dtype of {key} changed from {param.dtype} to {weight.dtype}")
            param.set_(weight.detach())  # the parameter is the global's tensor
            buf = self._buffer(key, create=True)
            for part, grad_part, buf_part in self._slices(param, grad, buf):
                self._update(part, grad_part, buf_part)

    @torch.no_grad()
    def first_non_finite(
        self, state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
    ) -> str | None:
        """The first key whose weight :meth:`step` would make non-finite (in the weight's
        dtype), else None: the same update on copies of one slice at a time, changing
        nothing."""
        for key, weight, grad in self._pairs(state, delta):
            buf = self._buffer(key, create=False)
            for part, grad_part, buf_part in self._slices(weight, grad, buf):
                trial = part.to("cpu", torch.float32, copy=True)
                if buf_part is not None:
                    buf_part = buf_part.clone()
                elif self.momentum > 0:  # as step's first: zeros, of one slice here
                    buf_part = torch.zeros_like(trial)
                self._update(trial, grad_part, buf_part)
                if not bool(torch.isfinite(trial.to(weight.dtype)).all()):
                    return key
        return None

    def reset(self) -> None:
        """Forget the momentum (an adopted global starts it again from zero)."""
        self.sgd.state.clear()

    def momentum_buffers(self) -> dict[str, torch.Tensor]:
        """The momentum buffers by tensor name (the optimizer's own tensors, not copies):
        what the outer state file holds as ``momentum/<name>``."""
        out = {}
        for key, param in self.params.items():
            buf = self.sgd.state.get(param, {}).get("momentum_buffer")
            if buf is not None:
                out[key] = buf
        return out

    def state_dict(self) -> StateDict:
        """The optimizer's ``state_dict`` (torch's: ``state`` by parameter index, over the
        optimizer's own buffers; ``param_groups`` with the tensor names)."""
        return self.sgd.state_dict()

    def load_state_dict(self, saved: StateDict | Mapping[str, torch.Tensor]) -> None:
        """Replace the momentum with ``saved``'s: a :meth:`state_dict` (its buffers matched
        by name) or a dict of buffers by tensor name (an outer state file, also of 2.1).
        Buffers are kept as float32 CPU clones; the hyperparameters stay this run's.
        ``ValueError`` for a buffer whose shape differs from its tensor's."""
        buffers: Mapping[str, torch.Tensor]
        if "state" in saved and "param_groups" in saved:
            names = [n for group in saved["param_groups"] for n in group["param_names"]]
            buffers = {
                names[int(i)]: entry["momentum_buffer"]
                for i, entry in saved["state"].items()
                if entry.get("momentum_buffer") is not None
            }
        else:
            buffers = saved
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
