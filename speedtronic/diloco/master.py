"""The master's round: one outer step from one contribution per node.

Round ``R`` is open while ``global/latest.safetensors`` holds outer step ``R``. Every
``poll_interval`` seconds (sooner when the local node uploaded) :meth:`RoundMaster.poll_once`
lists the repository, reads each node's status record and sorts the contribution files::

    round <= ledger[node]                       duplicate (a replay): pruned
    round <  R - max_staleness                  stale: dropped, pruned, counted
    R - max_staleness <= round <= R             included in the open round (late if < R)
    round >  R                                  early: left for its round

It closes round ``R`` when every *active* node (joined, not finished, not silent for
``drop_after`` round lengths) delivered its round-``R`` contribution, or ``round_timeout``
seconds after the round's first contribution arrived; never with fewer than ``min_nodes``
contributors (less the nodes that finished their run). Closing::

    new   = state.copy()                          # RoundState: all that a round changes
    mean  = sum(w_n * mean(files of n)) / sum(w_n)  # each file read once, streamed, float32
    new.ledger[n] = round of n's newest file      # exactly once
    SGD(nesterov).step(new.global, grad=mean); new.outer_step += 1
    write-ahead record; publish weights + ledger + prune in one commit
    state = new; persist; report; hand the global to the local node; evaluate

A failed publish leaves ``state`` as it was (nothing to roll back; a group leader whose
mean already went up keeps ``new`` instead, :mod:`speedtronic.diloco.relay`) and makes the next poll
agree with the exchange again (:mod:`speedtronic.diloco.reconcile`), since it may have landed:
the published ledger's record carries which nodes finished and as which instance, so the
adopted state knows them too; a master that finds its own run's global already final (a lost
reply to the last publish, a restart after it) finishes at once.
Every file is checked before it is used: its header names its node, round, run, instance and
base (any missing: refused and counted corrupt), it matches the model, it is finite, it is not
the node's last contribution again, and a ``weight`` other than 1 comes only from a node
listed in ``distributed.relay_leaders``. The run ends when no node is left to wait for and
the nodes finished by what the master aggregated (:mod:`speedtronic.diloco.roster`): then the
master publishes the final global and calls ``on_final``.

A failure the master cannot retry its way out of (an unusable global and no local state to
republish) is stored in :attr:`RoundMaster.fatal` and ends its thread; the coordinator raises
it. Transient failures are retried at every poll and logged once, then every 30 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.mailbox import Emit, ignore
from speedtronic.diloco.outer_state import OuterStateStore, RoundState
from speedtronic.diloco.reconcile import META, max_global_bytes, reconcile
from speedtronic.diloco.retry import AccessRefused, ExchangeError
from speedtronic.diloco.roster import IDENTITY_HEADERS, NodeView, Roster
from speedtronic.diloco.transport import RemoteNotFound, RepoScan, TransportError

__all__ = ["IDENTITY_HEADERS", "NodeView", "RoundMaster"]

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
        self._initial = T.cpu_state_dict(state)  # the global of a new run
        self.state = self._new_run()  # the whole round state (RoundState)
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
        self._first_arrival: float | None = None
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
        """The nodes of this exchange, by id (see :class:`~speedtronic.diloco.roster.Roster`)."""
        return self.roster.nodes

    def _new_run(self) -> RoundState:
        s = self.settings
        return RoundState.new(T.cpu_state_dict(self._initial), s.outer_lr, s.outer_momentum)

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
        """Agree with the exchange once (:mod:`speedtronic.diloco.reconcile`; a group leader
        takes the top-level global, :meth:`Upstream.agree`). A failed read raises
        ``TransportError`` (retried); an unusable global with no local state to republish
        raises ``ExchangeError``."""
        if self.upstream is not None:
            state = self.upstream.agree(self.store, self.state, max_global_bytes(self._initial))
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
        self._persist()
        report = self.outer_files.take_pending(self.outer_step, self.run_id)
        if report is not None:  # published by this master, never reported (killed, or lost reply)
            self._reset_tally()
            self._emit("outer_step", **{**report, "recovered": True})
        if self._handed != self.outer_step:  # a re-reconcile after a failed publish may not move
            self._opened = self._clock()
            self._hand_over(T.cpu_state_dict(self.global_state))
        if over and not self.finished.is_set():  # this run ended (a lost reply, a restart)
            self._finalize(T.cpu_state_dict(self.global_state))

    def _published_final(self, state: RoundState) -> bool:
        """The exchange holds ``state``'s global marked final: its run is over."""
        meta = self.store.global_metadata()
        return (
            meta is not None
            and meta.final
            and meta.run_id == state.run_id
            and meta.outer_step == state.outer_step
        )

    def _hand_over(self, state: dict[str, torch.Tensor]) -> None:
        self._handed = self.outer_step
        if self.on_global is not None:
            self.on_global(self.outer_step, state)

    # -- one poll ---------------------------------------------------------------------------
    def _reset_tally(self) -> None:
        """Start counting the open round's refused files afresh (after a close)."""
        self._counts = {"stale": 0, "skipped": 0, "corrupt": 0}
        self._dropped: list[str] = []  # "node/round" of stale contributions since the last close

    def _tally(self) -> dict[str, Any]:
        """The refused files since the last close, as ``outer_step`` and ``final_global``
        report them."""
        counts = {f"deltas_{kind}": count for kind, count in self._counts.items()}
        return {**counts, "dropped": list(self._dropped)}

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
        if self.roster.refresh(scan, now, self.outer_step):
            self.last_progress = now
        candidates = self._sort_contributions(scan, now)
        seen = {path for files in candidates.values() for path in files.values()}
        if seen - self._seen:  # a contribution not seen before
            self.last_progress = now
        self._seen = seen
        limit = self.settings.drop_after * max(
            self.settings.round_timeout, self.state.round_seconds
        )
        active = self.roster.active(now, limit, self.state)
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
                    self._heard(node_id, now)
        return candidates

    @property
    def max_delta_bytes(self) -> int:
        """The largest delta file this model can produce (float32 values + a header)."""
        values = sum(v.numel() for v in self._initial.values() if v.is_floating_point())
        return 4 * values + (1 << 20)

    def _refuse(self, path: str, why: str) -> None:
        """A contribution file that cannot be used: counted corrupt and pruned unread."""
        self._prune.add(path)
        self._counts["corrupt"] += 1
        _LOG.warning(f"dropping delta {path}: {why}")

    def _heard(self, node_id: str, now: float) -> None:
        if self._first_arrival is None:
            self._first_arrival = now
        self.roster.heard(node_id, now, self.outer_step)

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
        if active <= on_time:
            return "complete" if active else "drain"
        waited = now - (self._first_arrival if self._first_arrival is not None else now)
        if waited >= self.settings.round_timeout:
            return "timeout"
        return None

    # -- closing a round -----------------------------------------------------------------------
    def _close(
        self, candidates: Mapping[str, Mapping[int, str]], reason: str, active: set[str]
    ) -> bool:
        started = time.perf_counter()
        total = {
            k: torch.zeros(tuple(v.shape), dtype=torch.float32)
            for k, v in self._initial.items()
            if v.is_floating_point()
        }
        fold = _Fold()
        for node_id in sorted(candidates):
            self._fold_node(node_id, candidates[node_id], total, fold)
        if not fold.marks:
            return False
        for value in total.values():
            value.div_(float(fold.weight))
        new = self.state.copy()
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
        # is reported below leaves this record, reported at the restart (outer_state.py)
        self.outer_files.write_pending(new.outer_step, new.run_id, report)
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
            )
        except Exception:
            if self.upstream is not None:  # the top level holds the group's mean already:
                with self._lock:  # keep the round's ledger, so the members' files are never
                    self.state = new  # sent up again; agreeing retries the group's publish
                self._persist()
            self.reconciled = False  # it may still have landed: agree with the exchange again
            raise
        opened, self._opened = self._opened, self._clock()
        self.last_progress = self._opened
        length = self._opened - opened
        average = new.round_seconds  # kept in the state: a restart drops nobody too soon
        new.round_seconds = length if not average else (0.7 * average + 0.3 * length)
        with self._lock:
            self.state = new
        self._prune.clear()
        self._persist()
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
        new.optimizer.step(new.global_state, mean)
        if T.first_non_finite(new.global_state) is not None:
            return False
        new.outer_step += 1
        return True

    def _fold_node(
        self, node_id: str, files: Mapping[int, str], total: dict[str, torch.Tensor], fold: _Fold
    ) -> None:
        """Add one node's valid files for this round into ``total`` as their mean times the
        node's weight (1, or the nodes a relay leader speaks for), reading each file once,
        tensor by tensor, and record them in ``fold``. Unusable files are pruned and counted,
        and leave ``total`` untouched."""
        with contextlib.ExitStack() as stack:
            readers: list[tuple[int, str, T.DeltaReader, int]] = []
            for round, path in sorted(files.items()):
                try:
                    bound = self.max_delta_bytes  # checked on the file actually opened
                    local = stack.enter_context(self.store.local_copy(path, max_bytes=bound))
                    reader = stack.enter_context(T.open_delta(local))
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
        state = T.cpu_state_dict(self.global_state)
        self._hand_over(state)
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
        )
        # files refused after the last round (e.g. written once every node was done) are
        # reported here, or they would never be counted
        self._emit("final_global", outer_step=state.outer_step, **self._tally())
        self._reset_tally()
        self._finalize(T.cpu_state_dict(state.global_state))

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
