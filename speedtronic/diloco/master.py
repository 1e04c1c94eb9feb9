"""The master's round: one outer step from one contribution per node, and the global it publishes.

:class:`RoundMaster` polls the exchange, sorts the contribution files (duplicate, stale,
included, early) and closes the open round when every active node delivered or
``round_timeout`` passed, as a pipeline: fold (the valid files into one float32 running sum)
-> outer step -> publish (with the ledger, in one commit) -> report (docs/diloco.md, "Master
side", has the rules and the failure table). The outer step is one :class:`OuterStep`:
:class:`LocalStep` steps the global with the run's one outer optimizer (its update quantized
with ``global_dtype`` int8/int4, :func:`step_quantized`; with fp32 and fragments, the
new values of the round's tensors, :func:`~.codec.exact_update`; a node applies either with
:func:`~.codec.read_update`); a group leader's :class:`RelayStep` forwards the mean to the
top-level exchange. Memory: the held global, the outer momentum and one float32 running
sum; a delta is read a tensor at a time, the outer step runs a slice at a time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from speedtronic.background import Loop, wait_for
from speedtronic.diloco import codec
from speedtronic.diloco.codec import (
    QUANTIZED_BITS,
    HeldGlobal,
    OuterUpdate,
    QuantizedTensor,
    add_decoded,
    average_states,
    exact_update,
    quantize,
    state_digest,
)
from speedtronic.diloco.exchange import (
    Emit,
    ExchangeError,
    GlobalMetadata,
    RepoScan,
    RoundSettings,
    Store,
    ignore,
    max_global_bytes,
    parse_delta_path,
)
from speedtronic.diloco.ledger import (
    META,
    Bootstrap,
    ContributionFiles,
    NesterovOuterOptimizer,
    NodeView,
    OuterStateStore,
    Roster,
    RoundState,
    publish,
    publish_bootstrap,
    reconcile,
)
from speedtronic.retry import AccessRefused, RemoteNotFound, TransportError

__all__ = [
    "ETA_DIGITS",
    "META",
    "Fold",
    "LocalStep",
    "NesterovOuterOptimizer",
    "NormTally",
    "OuterStep",
    "OuterUpdate",
    "RelayStep",
    "RoundMaster",
    "RoundState",
    "RoundsStalledError",
    "Stepped",
    "adaptive_eta",
    "average_states",
    "squared_norm",
    "step_quantized",
]

_LOG = logging.getLogger("speedtronic.diloco")
FAILURE_LOG_SECONDS = 30.0  # a failure that repeats is logged again at most this often


# -- adaptive extrapolation and the final average (issue 33) ------------------------------
# FedExP (Jhunjhunwala et al., ICLR 2023). A round's contributions ``d_j`` with weights ``w_j``
# (1 a file; a relay leader's file counts for its group) give::
#
#     mean    = sum_j w_j d_j / W                     W = sum_j w_j
#     spread  = sum_j w_j ||d_j||^2 / W               the mean squared norm of a contribution
#     eta     = min(cap, max(1, c * spread / ||mean||^2))
#     global  = global - eta * mean                   (SGD, lr eta, no momentum)
#
# Identical contributions give ``spread == ||mean||^2`` (eta 1 for c <= 1); K orthogonal ones
# of equal norm give ``K``. :class:`NormTally` collects ``spread`` while the contributions are
# summed, a slice at a time, so the master's memory stays one running sum; ``||mean||^2`` is
# read from that sum afterwards (:func:`squared_norm`). Sums of squares are float64, and eta is
# rounded to :data:`ETA_DIGITS` decimals, so the order in which slices were added (a file read
# in chunks, the ideal's whole tensors) cannot change it: the master, a restarted master and
# :func:`speedtronic.testing.diloco_ideal.simulate` agree on it exactly.

#: eta is rounded to this many decimals (see the module docstring).
ETA_DIGITS = 6


def _sq(value: torch.Tensor) -> float:
    """``||value||^2`` in float64 (a float32 value's square is exact in float64)."""
    return float(value.detach().to(torch.float64).pow(2).sum())


class NormTally:
    """``sum_j w_j ||d_j||^2`` and ``sum_j w_j`` over a round's contributions, fed slice by slice.

    Call :meth:`add` with every decoded slice of contribution ``j`` (any partition of its
    values, in any order) and its weight, then :meth:`close` once per contribution with the
    same weight. :attr:`count` is the number of contributions closed.
    """

    def __init__(self) -> None:
        self.weighted_sq = 0.0
        self.weight = 0.0
        self.count = 0

    def add(self, part: torch.Tensor, weight: float = 1.0) -> None:
        """Add ``weight * ||part||^2`` (one slice of the contribution being read)."""
        self.weighted_sq += weight * _sq(part)

    def close(self, weight: float = 1.0) -> None:
        """One contribution of ``weight`` is complete."""
        self.weight += weight
        self.count += 1

    @property
    def spread(self) -> float:
        """``sum_j w_j ||d_j||^2 / W`` (0.0 before any contribution)."""
        return self.weighted_sq / self.weight if self.weight > 0 else 0.0


def squared_norm(state: Mapping[str, torch.Tensor], chunk: int = 1 << 18) -> float:
    """``||state||^2`` over every floating tensor, in float64, ``chunk`` values at a time (the
    temporaries stay one chunk however large a tensor is)."""
    total = 0.0
    for key in sorted(state):
        value = state[key]
        if not value.is_floating_point():
            continue
        flat = value.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk):
            total += _sq(flat[start : start + chunk])
    return total


def adaptive_eta(spread: float, mean_sq_norm: float, count: int, c: float, cap: float) -> float:
    """The round's outer lr: ``min(cap, max(1, c * spread / mean_sq_norm))``, rounded.

    Degenerate rounds step with 1.0 (plain averaging): fewer than two contributions (the ratio
    of one contribution to itself says nothing about how the nodes disagree), a zero mean (the
    step is zero whatever eta is) or a ratio that is not finite.
    """
    if count < 2 or mean_sq_norm <= 0.0:
        return 1.0
    ratio = c * spread / mean_sq_norm
    if not math.isfinite(ratio):
        return 1.0
    return round(min(cap, max(1.0, ratio)), ETA_DIGITS)


class RoundsStalledError(RuntimeError):
    """The rounds cannot go on: no progress for longer than any round may take, or fewer
    contributing nodes than ``min_nodes`` for as long (exit 1: a restart resumes them)."""


class Score(Protocol):
    """What ``evaluate`` returns for a global (read only: a frozen ``EvalResult`` is one)."""

    @property
    def loss(self) -> float: ...
    @property
    def perplexity(self) -> float: ...
    @property
    def tokens(self) -> int: ...


NewRun = Callable[[], RoundState]  # outer step 0 over the initial weights: a new run
Global = tuple[GlobalMetadata, dict[str, torch.Tensor]]  # a version record and its weights


@dataclasses.dataclass
class Fold:
    """What closing a round read: the round's mean (one float32 running sum, divided by the
    weight at the end), the files used and what they say about their nodes."""

    round: int
    total: dict[str, torch.Tensor]
    weight: int = 0
    included: list[str] = dataclasses.field(default_factory=list)
    consumed: list[str] = dataclasses.field(default_factory=list)
    marks: dict[str, int] = dataclasses.field(default_factory=dict)  # node -> newest round
    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    instances: dict[str, str] = dataclasses.field(default_factory=dict)
    finals: dict[str, int] = dataclasses.field(default_factory=dict)
    late: int = 0
    key_weights: dict[str, int] = dataclasses.field(default_factory=dict)  # per tensor
    moments: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # weighted sums
    moment_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    norms: NormTally = dataclasses.field(default_factory=NormTally)  # for outer_step: adaptive
    mean_moments: dict[str, torch.Tensor] | None = None  # as the nodes will decode them


@dataclasses.dataclass
class Stepped:
    """An outer step's lr (``eta``) and the update to publish (None: the global, whole)."""

    eta: float
    update: OuterUpdate | None = None
    #: A final global that is the mean of the last two: the update that made the last one
    #: (published beside it, so a node holding the one before computes the mean itself).
    last: OuterUpdate | None = None


@dataclasses.dataclass
class Agreement:
    """Where the master stands with the exchange: created there (not after a startup outage),
    agreed with since the start or the last failed publish, whether the first agreement may
    start a new run (``fresh``, from ``initial``), whether a valid local outer state may be
    republished, the outer step last handed to ``on_global``, and a new run's global 0
    announced but not published yet (``unpublished``: the files its publish prunes)."""

    initial: dict[str, torch.Tensor] | None = None
    fresh: bool = False
    exchange_created: bool = True
    reconciled: bool = False
    has_local_state: bool = False
    handed: int | None = None
    unpublished: list[str] | None = None


@dataclasses.dataclass
class RoundWatch:
    """The open round's ``clock()`` times (opened, first on-time contribution, last sign of
    progress, exchange unreadable since), what the last poll saw, and the expected nodes'
    first-round wait (over; the round that said it waits for them)."""

    opened: float
    last_progress: float
    first_arrival: float | None = None
    blind_since: float | None = None
    seen: set[str] = dataclasses.field(default_factory=set)
    joins_over: bool = False
    waiting_note: int | None = None
    active: set[str] = dataclasses.field(default_factory=set)  # what the last poll waited for
    short_note: int | None = None  # the round that said it waits for min_nodes


@dataclasses.dataclass
class Refusals:
    """The files the open round refused, counted until it closes (``dropped``: stale
    ``node/round``; ``refused``: corrupt ones, named by the next record), and the files to
    ``prune`` (refused, duplicate, stale or consumed) until a commit deletes them."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    prune: set[str] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Count afresh (after a close); the files to prune stay."""
        self.counts = {"stale": 0, "skipped": 0, "corrupt": 0}
        self.dropped, self.refused = [], []

    def report(self) -> dict[str, object]:
        """The counts as an event reports them."""
        counts = {f"deltas_{kind}": count for kind, count in self.counts.items()}
        return {**counts, "dropped": list(self.dropped), "refused": list(self.refused)}


class OuterStep(Protocol):
    """How a closed round's mean becomes the next global: :class:`LocalStep` steps it here,
    :class:`RelayStep` (a group leader) forwards it to the top-level exchange. The master
    calls each method at one place of its round and never asks which one it holds."""

    def agree(
        self,
        store: Store,
        held: RoundState,
        *,
        trusted: bool,
        fresh: bool,
        new_run: NewRun,
        bootstrap: Bootstrap | None = None,
    ) -> tuple[RoundState, bool]:
        """The state agreed with the exchange (held there when this returns, or by
        ``bootstrap`` for a new run's first global), and whether its global is the final one
        of a run that ended."""

    def moments_due(self, outer_step: int) -> bool:
        """Whether the round that makes global ``outer_step`` averages the first moments."""

    def step(self, new: RoundState, fold: Fold, *, final: bool) -> Stepped | None:
        """Make ``new`` (the closed round's state) the next global from the round's mean
        (``fold.total``); None when it would not be finite (``new`` is dropped)."""

    def undo(self, old: RoundState, new: RoundState) -> RoundState:
        """The state to hold when the publish of ``new`` failed and no local state keeps it."""

    def finish(self, state: RoundState) -> bool:
        """The run is over with no round left to close: make ``state`` the final global; True
        when that changed its weights."""


class RoundMaster:
    """Aggregates one contribution per node per round into the published global.

    ``state``: the model's weights (the global of a new run; every global is checked against
    its shapes and dtypes). ``on_global`` receives every new global, ``evaluate`` scores one,
    ``on_final`` runs once after the final global was published; ``outer`` is how a round's
    mean becomes the next global (:class:`LocalStep` by default; :class:`RelayStep` makes this
    master a group leader); ``own`` is the store on this host its own node hands its
    contributions to (:class:`~.ledger.ContributionFiles`). ``last_progress``: the
    ``clock()`` time of the last sign that the run moves (the coordinator bounds its wait for
    the final global from it).

    A poll sorts the exchange's files and closes the open round when it is due: fold (the
    valid files into the round's mean) -> outer step (``outer``) -> publish (one commit, the
    write-ahead record first) -> report; each step has its own failure rule.
    """

    def __init__(
        self,
        store: Store,
        state: Mapping[str, torch.Tensor],
        *,
        settings: RoundSettings,
        state_dir: str | os.PathLike[str],
        emit: Emit = ignore,
        on_global: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        evaluate: Callable[[dict[str, torch.Tensor]], Score | None] | None = None,
        on_final: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        outer: OuterStep | None = None,
        clock: Callable[[], float] = time.monotonic,
        own: Store | None = None,
    ):
        self.store = store
        self.files = ContributionFiles(store, own, state_dir)  # what the fold reads
        self.settings = settings
        self.state = self._new_run(codec.cpu_state_dict(state))
        # the global of a new run: only the first agreement with the exchange may start one
        self.agreement = Agreement(initial=self.state.global_state)
        self.outer_files = OuterStateStore(state_dir)
        self.fatal: Exception | None = None  # an error no retry fixes; the thread stopped
        self._emit = emit
        liveness, periodic = settings.rules.liveness_timeout, store.kind == "directory"
        self.roster = Roster(lambda n: self.store.read_owner(n), emit, liveness, periodic)
        self.on_global, self.evaluate, self.on_final = on_global, evaluate, on_final
        self.outer: OuterStep = outer or LocalStep(settings, self.outer_files)
        self._clock = clock
        self._lock = threading.RLock()
        self.finished = threading.Event()
        poll = settings.rules.poll_interval
        self._loop = Loop("speedtronic-diloco-master", self._tick, lambda: poll)
        self._failing: tuple[str, float, float] | None = None  # kind, since, last logged
        now = clock()
        self.watch = RoundWatch(opened=now, last_progress=now)
        self.refusals = Refusals()
        # (outer step, round, mean first moments) published with the last global that had them
        self.moments: tuple[int, int, dict[str, torch.Tensor]] | None = None
        self._load_local_state()

    @property
    def last_progress(self) -> float:
        """The ``clock()`` time of the last sign that the run moves."""
        return self.watch.last_progress

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
        """The nodes of this exchange, by id."""
        return self.roster.nodes

    def _new_run(self, initial: dict[str, torch.Tensor] | None = None) -> RoundState:
        """Outer step 0 over ``initial`` (kept, not copied) or a copy of the initial weights,
        with the run's one outer optimizer."""
        if initial is None:
            if self.agreement.initial is None:  # never: only the first agreement starts one
                raise RuntimeError("a new run can only start when the master starts")
            initial = codec.cpu_state_dict(self.agreement.initial)
        rule = self.settings.outer
        return RoundState(0, initial, NesterovOuterOptimizer(initial, rule.lr, rule.momentum))

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
            self.state, self.agreement.has_local_state = saved, True

    def _persist(self) -> None:
        try:
            self.outer_files.save(self.state)
            self.agreement.has_local_state = True
        except OSError as exc:
            _LOG.warning(f"could not persist local outer state: {exc}")

    def reconcile(self, *, announce: bool = False) -> None:
        """Agree with the exchange once (``outer.agree``: :func:`~.ledger.reconcile`, or a
        group leader takes the top-level global). A failed read raises ``TransportError``
        (retried); an unusable global with no local state to republish raises
        ``ExchangeError``. With ``announce`` (the coordinator's start) a new run's global 0
        is announced, and published by the round thread (:meth:`_announce`)."""
        state, over = self.outer.agree(
            self.store,
            self.state,
            trusted=self.agreement.has_local_state,
            fresh=self.agreement.fresh,
            new_run=self._new_run,
            bootstrap=self._announce if announce else None,
        )
        with self._lock:
            self.state = state
        agreed = self.agreement
        agreed.reconciled = True
        agreed.fresh = False  # a later reconcile (after a failed publish) is never a new run
        agreed.initial = None
        report = self.outer_files.take_pending(self.outer_step, self.run_id)
        eta = report.get("eta") if report is not None else None
        if (
            isinstance(eta, float)
            and report is not None
            and report["outer_step"] == state.outer_step
        ):
            state.eta = eta  # the adopted global's step: its lr is the write-ahead record's
        self._persist()
        if report is not None:  # published by this master, never reported (killed, lost reply)
            self.refusals.reset()
            self._emit("outer_step", **{**report, "recovered": True})
        if agreed.handed != self.outer_step:  # a re-reconcile after a failed publish may not move
            self.watch.opened = self._clock()
            self._hand_over()
        if over and not self.finished.is_set():  # this run ended (a lost reply, a restart)
            self._finalize(self.global_state)

    def _announce(self, store: Store, state: RoundState, prune: list[str]) -> None:
        """A new run: announce its global 0 (:meth:`~.exchange.Store.announce`: the record,
        no weights) and leave its publish to the round thread's next poll, which publishes its
        record before anything else and its weights file after it, on a thread of its own
        (:class:`~.exchange.WeightsUpload`); every node built like this one trains meanwhile,
        and follows the rounds by their updates. Where the
        announcement fails, or the first global is not global 0, it is published here."""
        if state.outer_step != 0:
            publish_bootstrap(store, state, prune)
            return
        try:
            store.announce(state.global_state, run_id=state.run_id)
        except TransportError as exc:
            _LOG.warning(f"could not announce the new run ({exc}); publishing global 0 now")
            publish_bootstrap(store, state, prune)
            return
        self.agreement.unpublished = list(prune)
        _LOG.info(f"run {state.run_id} announced: global 0 is uploaded beside the first round")

    def _hand_over(self) -> None:
        """Give the local node a copy of the new global (the held one steps in place)."""
        self.agreement.handed = self.outer_step
        if self.on_global is not None:
            self.on_global(self.outer_step, codec.cpu_state_dict(self.global_state))

    # -- one poll ---------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Scan the repository and close the open round when it is due; True if it closed."""
        now, watch = self._clock(), self.watch
        try:
            if not self.agreement.exchange_created:  # creating it failed at startup: again
                self.store.create_repo(private=True)
                self.agreement.exchange_created = True
            if not self.agreement.reconciled:  # at start, and again after a failed publish
                self.reconcile()
            if self.agreement.unpublished is not None:  # the announced global 0: its record
                prune = self.agreement.unpublished  # first, its weights file on a thread
                publish_bootstrap(self.store, self.state, prune, weights_later=True)
                self.agreement.unpublished = None
            scan = self.files.scan()
        except TransportError:
            if watch.blind_since is None:
                watch.blind_since = now
            raise
        if watch.blind_since is not None:  # while the exchange was unreadable nobody was
            blind, watch.blind_since = now - watch.blind_since, None  # silent: no drop for it
            self.roster.credit(blind)
            if watch.first_arrival is not None:
                watch.first_arrival += blind
        if self.roster.refresh(scan, now, self.state):
            watch.last_progress = now
        candidates, ahead = self._sort_contributions(scan, now)
        self.files.prefetch(candidates, self.max_delta_bytes, ahead)  # beside the round
        seen = {path for files in candidates.values() for path in files.values()}
        if seen - watch.seen:  # a contribution not seen before
            watch.last_progress = now
        watch.seen = seen
        dropped = dict(self.state.dropped)
        limit, since = self.silence_limit, watch.first_arrival
        active = watch.active = self.roster.active(now, limit, self.state, since)
        if self.state.dropped != dropped:  # a drop holds across a restart
            self._persist()
        reason = self._close_reason(now, active, candidates)
        if reason is not None and self._close(candidates, reason, active):
            return True
        if self.refusals.prune:  # refused, duplicate or stale files go now, before re-sent
            try:
                self.store.prune(self.files.remote(self.refusals.prune))
                self.files.release(self.refusals.prune)
                self.refusals.prune.clear()
            except TransportError as exc:
                _LOG.warning(f"could not prune consumed deltas: {exc}")
        over = self.roster.run_over(active, self.state) and not candidates
        if over and not self.finished.is_set():
            self._finish()
        return False

    def _sort_contributions(
        self, scan: RepoScan, now: float
    ) -> tuple[dict[str, dict[int, str]], list[str]]:
        """Includable files ``{node: {round: path}}``, and those of the round after the open
        one (``sync: overlapped`` keeps several in flight: copied while the open round closes,
        one round ahead, so ``fetched/`` holds at most two rounds' files); duplicates and
        stale ones are queued for pruning and counted (a stale one moves the ledger: it is
        never counted later)."""
        open_round = self.outer_step
        oldest = open_round - self.settings.rules.max_staleness
        candidates: dict[str, dict[int, str]] = {}
        ahead: list[str] = []
        for node_id, files in scan.deltas.items():
            done = self.ledger.get(node_id, -1)
            for round, path in sorted(files.items()):
                if path in self.refusals.prune:
                    continue
                if round <= done:
                    self.refusals.prune.add(path)
                    self.refusals.counts["skipped"] += 1
                elif round < oldest:
                    self._drop(node_id, round, path)
                    _LOG.warning(
                        f"dropping the contribution of {node_id} to round {round}: "
                        f"{open_round - round} rounds late (max_staleness "
                        f"{self.settings.rules.max_staleness})"
                    )
                    with self._lock:
                        self.ledger[node_id] = max(self.ledger.get(node_id, -1), round)
                elif round <= open_round:
                    size = scan.size(path)
                    if size is not None and size > self.max_delta_bytes:
                        self._refuse(path, f"{size} bytes, more than a delta of this model")
                        continue
                    candidates.setdefault(node_id, {})[round] = path
                    if round == open_round and self.watch.first_arrival is None:
                        self.watch.first_arrival = now  # a late file must not shorten the wait
                    self.roster.heard(node_id, now, self.state)
                elif round == open_round + 1 and (scan.size(path) or 0) <= self.max_delta_bytes:
                    ahead.append(path)
        return candidates, sorted(ahead)

    @property
    def silence_limit(self) -> float:
        """Seconds of silence before a node is no longer waited for: ``drop_after`` round
        lengths, each at least ``round_timeout``."""
        rules = self.settings.rules
        return rules.drop_after * max(rules.round_timeout, self.state.round_seconds)

    @property
    def max_delta_bytes(self) -> int:
        """The largest delta file this model can produce (float32 values, and as many first
        moments with ``sync_inner_momentum``, + a header)."""
        values = sum(v.numel() for v in self.global_state.values() if v.is_floating_point())
        copies = 1 if self.settings.outer.moments == "off" else 2  # + the first moments
        return 4 * copies * values + (1 << 20)

    def _drop(self, node_id: str, round: int, path: str) -> None:
        """A stale contribution (too late, or of another run): pruned and counted."""
        self.refusals.prune.add(path)
        self.refusals.counts["stale"] += 1
        self.refusals.dropped.append(f"{node_id}/{round}")

    def _refuse(self, path: str, why: str) -> None:
        """An unusable contribution: counted corrupt and pruned unread; the next published
        record names it (``refused``), so its node hears of it."""
        self.refusals.prune.add(path)
        self.refusals.counts["corrupt"] += 1
        parsed = parse_delta_path(path)
        if parsed is not None:
            self.refusals.refused.append(f"{parsed[0]}/{parsed[1]}")
        _LOG.warning(f"dropping delta {path}: {why}")

    def _close_reason(
        self, now: float, active: set[str], candidates: Mapping[str, Mapping[int, str]]
    ) -> str | None:
        if not candidates:
            return None
        # min_nodes is a floor on the nodes in a round, lowered only by nodes that finished
        need = max(1, self.settings.rules.min_nodes - self.roster.finished_count(self.state))
        if len(candidates) < need:
            self._too_few(now, len(candidates), need)
            return None
        on_time = {node for node, files in candidates.items() if self.outer_step in files}
        starting = self._starting(candidates)
        if active <= on_time and not (starting and active):
            return "complete" if active else "drain"
        first = self.watch.first_arrival
        waited = now - (first if first is not None else now)
        if waited < (self.silence_limit if starting else self.settings.rules.round_timeout):
            return None
        if starting:  # the round waited its bound for them: no longer (they join later)
            self.watch.joins_over = True
            expected = self.settings.rules.expected_nodes
            _LOG.warning(
                f"round {self.outer_step} closes without {starting} of the {expected} expected "
                f"nodes (distributed.expected_nodes): nothing from them {waited:.0f} s after "
                "the round's first contribution (distributed.drop_after x round_timeout); no "
                "longer waiting for them (a node that starts later joins when it announces itself)"
            )
            self._emit(
                "nodes_missing", outer_step=self.outer_step, expected=expected, missing=starting
            )
        return "timeout"

    def _too_few(self, now: float, count: int, need: int) -> None:
        """The round has fewer contributing nodes than ``min_nodes``: it stays open, says so
        once, and past :attr:`silence_limit` after its first contribution the master stops
        (:class:`RoundsStalledError`: a run that must not drift to fewer nodes ends)."""
        first = self.watch.first_arrival
        if first is None:
            return
        bound, waited = self.silence_limit, now - first
        if waited > bound:
            raise RoundsStalledError(
                f"round {self.outer_step} has {count} of distributed.min_nodes {need} "
                f"contributing nodes after {waited:.0f} s (bound {bound:.0f} s: drop_after x "
                "round_timeout); stopping rather than closing it short (the state is saved: "
                "restart with --resume once enough nodes run)"
            )
        if self.watch.short_note != self.outer_step:
            self.watch.short_note = self.outer_step
            _LOG.warning(
                f"round {self.outer_step} waits for distributed.min_nodes: {count} of {need} "
                f"nodes contributed; waiting up to {bound:.0f} s after its first contribution"
            )
            self._emit("min_nodes_wait", outer_step=self.outer_step, nodes=count, need=need)

    def membership(self) -> tuple[int, dict[str, float]]:
        """The nodes the open round waits for, and the seconds since each training node was
        last seen (a contribution, a status record, a beat), for ``/metrics``."""
        return len(self.watch.active), self.roster.last_seen(self._clock())

    def _starting(self, candidates: Mapping[str, Mapping[int, str]]) -> int:
        """How many of the ``expected_nodes`` have not contributed to this run yet: the round
        waits for them up to :attr:`silence_limit` (a slow start is not a slow round), once
        per run."""
        expected = self.settings.rules.expected_nodes
        if self.watch.joins_over or expected <= 0:
            return 0
        started = len(set(self.ledger) | set(candidates))
        if started >= expected:
            self.watch.joins_over = True
            _LOG.info(f"all {expected} expected nodes (distributed.expected_nodes) contributed")
            return 0
        if self.watch.waiting_note != self.outer_step:
            self.watch.waiting_note = self.outer_step
            _LOG.info(
                f"round {self.outer_step} waits for {expected - started} more node(s) to start "
                f"and contribute (distributed.expected_nodes={expected}; at most "
                f"{self.silence_limit:.0f} s after the round's first contribution)"
            )
        return expected - started

    # -- closing a round: fold -> outer step -> publish -> report ------------------------------
    def _close(
        self, candidates: Mapping[str, Mapping[int, str]], reason: str, active: set[str]
    ) -> bool:
        """Close the open round from ``candidates``; True when its global was published."""
        started = time.perf_counter()
        fold = self._fold(candidates)
        if fold is None:  # nothing usable: the round stays open
            return False
        new = self._next_state(fold)
        final = self.roster.run_over(self.roster.waiting(new), new)
        stepped = self.outer.step(new, fold, final=final)
        if stepped is None:  # not finite: the round is undone, its files go
            for path in fold.consumed:
                self._refuse(path, "the outer step would make the global non-finite")
            return False
        fold.total = {}  # the mean is spent: let it go before the publish
        report = self._report(new, fold, reason, active, stepped.eta)
        firsts = [n for n, v in self.roster.nodes.items() if v.first_due and n in fold.marks]
        self._publish_round(new, fold, stepped, final, report)
        self._report_round(new, fold, report, started)
        self._first_included(firsts)
        self._after_publish(final)
        return True

    def _first_included(self, nodes: Sequence[str]) -> None:
        """The first contribution of each of ``nodes`` since it joined (or came back) is in
        the published global: how long that took from its process start and announcement."""
        for node_id in nodes:
            view = self.roster.nodes[node_id]
            view.first_due = False
            since_start = None if view.started is None else round(time.time() - view.started, 2)
            since_join = round(self._clock() - view.joined_at, 2)
            _LOG.info(
                f"node {node_id}: first contribution in global {self.outer_step}, {since_start} s "
                f"after its process started ({since_join} s after it announced itself)"
            )
            self._emit(
                "node_first_included",
                node_id=node_id,
                outer_step=self.outer_step,
                since_start_s=since_start,
                since_join_s=since_join,
            )

    def _fold(self, candidates: Mapping[str, Mapping[int, str]]) -> Fold | None:
        """Every node's valid files into one float32 running sum, divided into the round's
        mean, and the mean first moments; None when no file was usable (pruned, counted)."""
        total = {
            k: torch.zeros(tuple(v.shape), dtype=torch.float32)
            for k, v in self.global_state.items()
            if v.is_floating_point()
        }
        fold = Fold(self.outer_step, total)
        for node_id in sorted(candidates):
            self._fold_node(node_id, candidates[node_id], fold)
            # the file's temporaries, before the next file's
            codec.return_free_memory(beside_training=self.settings.rules.beside_training)
        if not fold.marks:
            return None
        # the mean of each tensor the files held (streamed: a fragment's; else every one)
        fold.total = {
            k: v.div_(float(fold.key_weights[k])) for k, v in total.items() if k in fold.key_weights
        }
        fold.mean_moments = self._mean_moments(fold)
        return fold

    def _next_state(self, fold: Fold) -> RoundState:
        """A copy of the held state (the weights step in place) with ``fold``'s records."""
        new = self.state.copy(tensors=False)
        for node_id, newest in fold.marks.items():
            new.ledger[node_id] = max(new.ledger.get(node_id, -1), newest)
            new.finals.pop(node_id, None)  # a node that contributes again is not done yet
        new.digests.update(fold.digests)
        new.instances.update(fold.instances)
        new.finals.update(fold.finals)
        return new

    def _report(
        self, new: RoundState, fold: Fold, reason: str, active: set[str], eta: float
    ) -> dict[str, object]:
        return {  # what the ``outer_step`` event says of the round that made ``new``
            "outer_step": new.outer_step,
            "round": fold.round,
            "reason": reason,
            "nodes_active": len(active),
            "nodes_included": len(fold.marks),
            "deltas_found": len(fold.consumed) + self.refusals.counts["corrupt"],
            "deltas_included": len(fold.consumed),
            "deltas_late": fold.late,
            "included": fold.included,
            "eta": eta,
            **self.refusals.report(),
        }

    def _publish_round(
        self,
        new: RoundState,
        fold: Fold,
        stepped: Stepped,
        final: bool,
        report: Mapping[str, object],
    ) -> None:
        """Publish ``new`` in one commit, its report written ahead (a kill after the exchange
        applied the publish leaves the record, reported at the restart). A failure may have
        landed: the next poll agrees again. The closed round is kept (its ledger marks the
        consumed files) and published again from the local state (whole: an update is sent
        once); with no local state to trust, ``outer.undo`` says which state to hold."""
        self.outer_files.write_pending(new.outer_step, new.run_id, report)
        old = self.state
        with self._lock:
            self.state = new
        moments, prune = fold.mean_moments, set(fold.consumed) | self.refusals.prune
        try:
            publish(
                self.store,
                new,
                prune=self.files.remote(prune),
                final=final,
                refused=self.refusals.refused,
                update=stepped.update,
                last_update=stepped.last,
                mean_of_two=stepped.last is not None,
                moments=moments,
                moments_round=None if moments is None else fold.round,
            )
        except Exception:
            self._persist()
            if self.agreement.has_local_state:
                self.refusals.prune.update(fold.consumed)  # consumed: go with the next commit
                self.watch.first_arrival = None
            else:
                with self._lock:
                    self.state = self.outer.undo(old, new)  # weights replaced when adopted
            self.agreement.reconciled = False
            raise
        self.files.release(prune)

    def _report_round(
        self, new: RoundState, fold: Fold, report: Mapping[str, object], started: float
    ) -> None:
        """The round landed: its length, the state kept, the event, the record cleared."""
        watch = self.watch
        opened, watch.opened = watch.opened, self._clock()
        watch.last_progress = watch.opened
        length = watch.opened - opened
        average = new.round_seconds  # kept in the state: a restart drops nobody too soon
        new.round_seconds = length if not average else (0.7 * average + 0.3 * length)
        self.refusals.prune.clear()
        self._persist()
        codec.return_free_memory(beside_training=self.settings.rules.beside_training)
        watch.first_arrival = None
        self.refusals.reset()
        self._emit(
            "outer_step", **report, seconds=time.perf_counter() - started, round_seconds=length
        )
        self.outer_files.clear_pending()
        moments = fold.mean_moments
        self.moments = None if moments is None else (new.outer_step, fold.round, moments)

    def _add_moments(self, reader: codec.DeltaReader, weight: float, fold: Fold) -> None:
        """Add the first moments ``reader``'s file carries, times ``weight``, to the round's
        sums (a second running sum, key by key)."""
        view = {}
        for key in reader.moment_keys():
            like = self.global_state[key[len(codec.MOMENT_PREFIX) :]]
            view[key] = fold.moments.setdefault(key, torch.zeros(tuple(like.shape)))
            fold.moment_weights[key] = fold.moment_weights.get(key, 0.0) + weight
        if view:
            reader.add_to(view, scale=weight)

    def _mean_moments(self, fold: Fold) -> dict[str, torch.Tensor] | None:
        """The round's mean first moments by parameter name, as the nodes will decode them
        (through ``delta_dtype`` like their own, no error feedback); None when none came."""
        if not fold.moments:
            return None
        n = len(codec.MOMENT_PREFIX)
        mean = {k[n:]: v.div_(fold.moment_weights[k]) for k, v in fold.moments.items()}
        wire = self.settings.wire
        if wire.delta_dtype == "fp32":
            return mean
        encoded = codec.encode_delta(mean, wire.delta_dtype, wire.block_size)
        return {k: codec.decode_value(v) for k, v in encoded.items()}

    def _fold_node(self, node_id: str, files: Mapping[int, str], fold: Fold) -> None:
        """Add one node's valid files for this round into ``fold.total`` as their mean times the
        node's weight (1, or the nodes a relay leader speaks for), each file read once, tensor
        by tensor, and record them in ``fold``. Unusable files are pruned and counted."""
        with contextlib.ExitStack() as stack:
            readers: list[tuple[int, str, codec.DeltaReader, int]] = []
            for round, path in sorted(files.items()):
                opened = self._open_checked(stack, node_id, round, path)
                if opened is None:
                    continue
                reader, weight, digest = opened
                readers.append((round, path, reader, weight))
                fold.digests[node_id] = digest
                fold.instances[node_id] = reader.metadata["instance"]
                if reader.metadata.get("final") == "true":
                    fold.finals[node_id] = round
            if not readers:
                return
            weight = max(w for _, _, _, w in readers)
            share = weight / len(readers)  # several files of one node: each counts its share
            # of each tensor (a fragment's file holds some): the files that hold it share it
            holders = collections.Counter(k for *_, r, _ in readers for k in r.model_keys())
            moments = self.outer.moments_due(self.outer_step + 1)
            for round, _, reader, _ in readers:
                observe = functools.partial(fold.norms.add, weight=share)
                scales = {key: weight / holders[key] for key in reader.model_keys()}
                reader.add_to(fold.total, scale=scales, observe=observe)
                fold.norms.close(share)
                if moments and round == self.outer_step:  # a late file's moments: too old
                    self._add_moments(reader, weight, fold)
        fold.weight += weight
        for key in holders:
            fold.key_weights[key] = fold.key_weights.get(key, 0) + weight
        for round, path, _, _ in readers:
            fold.included.append(f"{node_id}/{round}")
            fold.consumed.append(path)
            fold.late += round < self.outer_step
            fold.marks[node_id] = max(fold.marks.get(node_id, -1), round)

    def _open_checked(
        self, stack: contextlib.ExitStack[bool | None], node_id: str, round: int, path: str
    ) -> tuple[codec.DeltaReader, int, str] | None:
        """``node_id``'s contribution to ``round`` at ``path``, opened (kept open by
        ``stack``) and checked: its size on the file read, identity, values and digest, not a
        re-sent copy, of this run. Returns its reader, weight and digest; None when it is gone
        or unusable (pruned and counted). An outage raises (the round is retried)."""
        try:
            bound = self.max_delta_bytes  # checked on the file actually opened
            local = stack.enter_context(self.files.open(path, bound))
            reader = stack.enter_context(codec.open_delta(local))
            leaders, step = self.settings.rules.relay_leaders, self.outer_step
            weight = self.roster.check_identity(node_id, reader.metadata, round, step, leaders)
            digest = reader.check(self.global_state, partial=self.settings.rules.fragments > 1)
            if self.state.digests.get(node_id) == digest:
                raise ValueError("the same values as its node's last contribution")
        except RemoteNotFound:
            return None
        except TransportError as exc:
            if exc.kind != "permanent":
                raise  # an outage: the whole round is retried at the next poll
            self._refuse(path, str(exc))  # too large, a link: never usable
            return None
        except Exception as exc:
            self._refuse(path, f"{type(exc).__name__}: {exc}")
            return None
        run = reader.metadata["run_id"]
        if run and self.run_id and run != self.run_id:
            self._drop(node_id, round, path)
            _LOG.warning(f"dropping {path}: it belongs to another run ({run})")
            return None
        return reader, weight, digest

    def _after_publish(self, final: bool) -> None:
        self._hand_over()
        state = self.global_state  # read while the master thread does nothing else
        self._score(state, final=final)
        if final:
            self._finalize(state)

    def _score(self, state: dict[str, torch.Tensor], *, final: bool) -> None:
        """An ``eval`` event for ``state`` (``final``: the final model) when it scores one."""
        result = self.evaluate(state) if self.evaluate is not None else None
        if result is not None:
            self._emit(
                "eval",
                scope="global",
                outer_step=self.outer_step,
                step=self.settings.rules.steps_behind(self.outer_step),
                loss=result.loss,
                perplexity=result.perplexity,
                tokens=result.tokens,
                final=final,
            )

    def _finish(self) -> None:
        """Every node is done and nothing is left: mark the published global final (with
        ``outer.finish``: the mean of the last globals, or a group leader first tells the top
        level that its group is done)."""
        changed = self.outer.finish(self.state)  # else the record alone marks the run final
        two = changed and self.settings.outer.final_average == 2  # the mean of the last two
        publish(
            self.store,
            self.state,
            final=True,
            refused=self.refusals.refused,
            weights=changed,
            mean_of_two=two,
        )
        self._persist()
        # files refused after the last round are reported here, or they would never be counted
        self._emit("final_global", outer_step=self.outer_step, **self.refusals.report())
        self.refusals.reset()
        if self.settings.outer.final_average > 1:  # a model no round scored: the mean
            self._score(self.global_state, final=True)
        self._finalize(self.global_state)

    def _finalize(self, state: dict[str, torch.Tensor]) -> None:
        if self.on_final is not None:
            self.on_final(self.outer_step, state)
        _LOG.info(f"final global published at outer step {self.outer_step}")
        self.finished.set()

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Run :meth:`poll_once` on a daemon thread until stopped, finished or fatal."""
        if not self._loop.running:
            self.watch.last_progress = self._clock()
            self._loop.start()

    def wake(self) -> None:
        """Poll now (the local node uploaded)."""
        self._loop.wake()

    def _tick(self) -> bool:
        try:
            if self.poll_once():
                self._loop.wake()  # a round closed: look again at once
        except (ExchangeError, AccessRefused, RoundsStalledError) as exc:  # no retry fixes it
            _LOG.error(str(exc))  # the coordinator raises it on the training thread
            self.fatal = exc
            return True
        except TransportError as exc:
            self._failed(logging.WARNING, exc)
        except Exception as exc:  # never let the aggregation thread die silently
            self._failed(logging.ERROR, exc)
        else:
            if self._failing is not None:
                since = time.monotonic() - self._failing[1]
                _LOG.info(f"master round works again after {since:.0f} s")
                self._failing = None
        return self.finished.is_set()

    def _failed(self, level: int, exc: Exception) -> None:
        """The first failure of a kind is logged, then one line per ``FAILURE_LOG_SECONDS``
        while the same kind repeats."""
        now, kind = time.monotonic(), type(exc).__name__
        if self._failing is None or self._failing[0] != kind:
            self._failing = (kind, now, now)
            _LOG.log(level, f"master round failed ({kind}); retrying at every poll: {exc}")
        elif now - self._failing[2] >= FAILURE_LOG_SECONDS:
            self._failing = (kind, self._failing[1], now)
            since = now - self._failing[1]
            _LOG.log(level, f"master round still failing after {since:.0f} s ({kind}): {exc}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (bounded join; a weights file still on its way is waited for as
        long); state is persisted after every round."""
        self._loop.stop(timeout)
        if self.store.weights_upload is not None:
            self.store.weights_upload.wait(timeout)

    def state_dict(self) -> dict[str, object]:
        """Outer step and ledger (the tensors live in ``state_dir`` and the repository)."""
        with self._lock:
            return {"outer_step": self.outer_step, "ledger": dict(self.ledger)}


# -- the outer step: taken here, or forwarded upstream --------------------------------------
class LocalStep:
    """The outer step taken here (:class:`OuterStep`): the round's lr (or the adaptive eta),
    the run's one outer optimizer on the global (its update quantized with ``global_dtype``
    int8/int4), the first moments averaged when due, and with ``final_average`` N > 1 the
    globals kept in ``files`` so that the final global is the mean of the last N."""

    def __init__(self, settings: RoundSettings, files: OuterStateStore) -> None:
        self.settings = settings
        self.files = files

    def agree(
        self,
        store: Store,
        held: RoundState,
        *,
        trusted: bool,
        fresh: bool,
        new_run: NewRun,
        bootstrap: Bootstrap | None = None,
    ) -> tuple[RoundState, bool]:
        """:func:`~.ledger.reconcile`, then the record read (before it counts as agreed: a
        failed read agrees again at the next poll) to say whether this run ended."""
        state = reconcile(
            store, held, trusted=trusted, fresh=fresh, new_run=new_run, bootstrap=bootstrap
        )
        meta = store.global_metadata()
        key = (state.run_id, state.outer_step)
        return state, meta is not None and meta.final and (meta.run_id, meta.outer_step) == key

    def moments_due(self, outer_step: int) -> bool:
        """The rounds ``sync_inner_momentum`` names."""
        return self.settings.outer.syncs_moments(outer_step)

    def step(self, new: RoundState, fold: Fold, *, final: bool) -> Stepped | None:
        """The outer step on ``new`` with the round's lr, from the global kept on disk when
        the final model is a mean; the final global is that mean, published whole."""
        mean = fold.total
        eta = self._eta(new, fold.norms, mean)
        self._keep(new)  # the global this round steps from
        new.optimizer.lr = new.eta = eta  # this round's (the same every round but with adaptive)
        if new.optimizer.first_non_finite(new.global_state, mean) is not None:
            return None  # checked on temporaries: nothing changed
        update = self._apply(new, mean)
        if final and self._final_mean(new):  # the final global is published whole
            two = self.settings.outer.final_average == 2
            return Stepped(eta, None, update if two else None)
        return Stepped(eta, update)

    def undo(self, old: RoundState, new: RoundState) -> RoundState:
        """The held state: the exchange's global is agreed again, the round closes anew."""
        return old

    def finish(self, state: RoundState) -> bool:
        """The final global: the mean of the last ``final_average`` globals."""
        return self._final_mean(state)

    def _eta(self, state: RoundState, norms: NormTally, mean: Mapping[str, torch.Tensor]) -> float:
        """The optimizer's lr (``outer_lr``; 1.0 for ``average``), or the adaptive eta."""
        rule = self.settings.outer
        if rule.kind != "adaptive":
            return state.optimizer.lr
        return adaptive_eta(
            norms.spread, squared_norm(mean), norms.count, rule.adaptive_c, rule.adaptive_max
        )

    def _apply(self, new: RoundState, mean: Mapping[str, torch.Tensor]) -> OuterUpdate | None:
        """Step ``new``'s global in place; with ``global_dtype`` int8/int4, the update it
        publishes (the global becomes the last one plus the decoded update); with fp32, the
        new values of a streamed round's tensors (None for a round of every tensor: the
        update would be the weights file)."""
        wire = self.settings.wire
        if wire.global_dtype == "fp32":
            moved = [k for k in mean if new.global_state[k].is_floating_point()]
            floating = sum(v.is_floating_point() for v in new.global_state.values())
            base = state_digest(new.global_state) if len(moved) < floating else None
            new.optimizer.step(new.global_state, mean)
            new.outer_step += 1
            if base is None:
                return None
            update = exact_update(new.global_state, moved, new.outer_step - 1, base)
            update.outer_step, update.run_id = new.outer_step, new.run_id
            update.digest = state_digest(new.global_state)
            return update
        update = step_quantized(
            new.optimizer,
            new.global_state,
            mean,
            new.residual,
            dtype=wire.global_dtype,
            block_size=wire.block_size,
            error_feedback=wire.error_feedback,
        )
        update.base_step, update.run_id = new.outer_step, new.run_id
        new.outer_step += 1
        update.outer_step, update.digest = new.outer_step, state_digest(new.global_state)
        return update

    def _keep(self, state: RoundState) -> None:
        """Keep ``state``'s global on disk when the final model is a mean of several."""
        n = self.settings.outer.final_average
        if n > 1:
            self.files.keep_global(state.outer_step, state.run_id, state.global_state, n)

    def _final_mean(self, state: RoundState) -> bool:
        """``final_average`` N > 1: make ``state``'s global the mean of the last N globals
        (fewer when fewer were made), read from the kept files, so a retry or a restart
        computes the same; True if it did."""
        n = self.settings.outer.final_average
        if n == 1:
            return False
        self._keep(state)
        kept = self.files.kept_globals(state.run_id, state.outer_step - n + 1, state.outer_step)
        for key, value in average_states(kept).items():
            state.global_state[key] = value.to(state.global_state[key].dtype)
        _LOG.info(f"the final global is the mean of the last {len(kept)} globals")
        return True


class RelayStep:
    """A group leader's outer step (:class:`OuterStep`, docs/diloco.md "relay groups"): its
    members' mean goes up to the top-level exchange ``store`` as one contribution weighing as
    many nodes, and the top-level global of the next round comes back to them (G + 1
    top-level commits a round for K nodes in G groups). It steps, averages and keeps nothing
    itself. ``record(**status)`` builds its status record there; ``stop`` ends a wait."""

    def __init__(
        self,
        store: Store,
        *,
        node_id: str,
        settings: RoundSettings,
        record: Callable[..., dict[str, object]],
        stop: threading.Event,
    ) -> None:
        self.store = store
        self.node_id = node_id
        self.settings = settings
        self._record = record
        self._stop = stop
        self.instance = str(record().get("instance", ""))
        self.max_bytes: int | None = None  # set by the master from its model
        self.last_round: int | None = None  # the last round this group contributed to
        self.held: Global | None = None  # the last top-level global (updates may apply to it)

    def _wait(self, than: int, run_id: str, what: str, timeout: float | None = None) -> Global:
        """The first top-level global newer than ``than`` (or of another run); past ``timeout``
        seconds (None: until stopped) a ``TransportError`` (the master retries it)."""

        def newer() -> Global | None:
            if self._stop.is_set():
                return None
            try:
                meta = self.store.global_metadata()
                if meta is None:
                    return None
                if meta.outer_step > than or (run_id and meta.run_id != run_id):
                    return self._fetch(meta)
                return None
            except TransportError as exc:
                _LOG.warning(f"relay: reading the top-level global failed: {exc}")
                return None

        started = time.monotonic()
        found = wait_for(
            newer, timeout=timeout, interval=self.settings.rules.poll_interval, stop=self._stop
        )
        if found is not None:
            return found
        if self._stop.is_set():
            raise TransportError(f"relay stopped while waiting for {what}")
        raise TransportError(
            f"relay: no {what} within {time.monotonic() - started:.1f} s "
            f"(distributed.round_timeout {timeout:g} s); waiting again at the master's next poll"
        )

    def _fetch(self, meta: GlobalMetadata) -> Global:
        """The top-level global ``meta`` names: the last one held + the updates after it when
        they apply (``global_dtype`` int8/int4), else the full global."""
        if self.held is not None and meta.updates_after(self.held[0].outer_step) is not None:
            last, weights = self.held
            held = HeldGlobal.of(last.outer_step, last.run_id, weights)
            with contextlib.suppress(ValueError, RemoteNotFound):
                self.held = meta, self.store.apply_updates(meta, held, like=weights)[0].state
                return self.held
        self.held = self.store.fetch_global(meta, max_bytes=self.max_bytes)
        return self.held

    def current(self) -> Global:
        """The top-level global (waits for the top-level master's first publish)."""
        self.store.claim_owner(self.node_id, self._record(state="training", relay=True))
        # bounded: at startup this runs on the training thread (the master retries it)
        return self._wait(-1, "", "first top-level global", self.settings.rules.round_timeout)

    def agree(self, store: Store, held: RoundState, **_: object) -> tuple[RoundState, bool]:
        """The group's state becomes the top-level global (outer step, run id), published to
        the group's ``store`` unless there. ``held`` keeps its ledger: after a group publish
        that failed once the mean went up, no member's file is sent up twice."""
        self.max_bytes = max_global_bytes(held.global_state)
        meta, weights = self.current()
        state = held.copy()
        state.adopt(weights, meta.outer_step)
        state.run_id = meta.run_id
        remote = store.global_metadata()
        if remote is None or (remote.outer_step, remote.run_id) != (meta.outer_step, meta.run_id):
            publish(store, state, relay="true")
        return state, False

    def moments_due(self, outer_step: int) -> bool:
        """Never: a leader relays the weights only."""
        return False

    def step(self, new: RoundState, fold: Fold, *, final: bool) -> Stepped:
        """Send the mean up (a long wait: no lock is held) and adopt the global after it."""
        meta, weights = self.forward(
            fold.total, round=new.outer_step, weight=fold.weight, run_id=new.run_id, final=final
        )
        new.adopt(weights, meta.outer_step)
        new.run_id = meta.run_id
        return Stepped(new.optimizer.lr)

    def undo(self, old: RoundState, new: RoundState) -> RoundState:
        """The closed round: its mean is at the top level already."""
        return new

    def forward(
        self, mean: Mapping[str, torch.Tensor], *, round: int, weight: int, run_id: str, final: bool
    ) -> Global:
        """Upload the group's ``mean`` as its contribution to ``round`` (weighing ``weight``
        nodes), then return the first top-level global after it."""
        status = {"state": "done", "final_round": round} if final else {"state": "training"}
        started = time.perf_counter()
        self.store.upload_delta(
            mean,
            node_id=self.node_id,
            round_index=round,
            local_step=round,
            base_outer_step=round,
            dtype=self.settings.wire.delta_dtype,
            block_size=self.settings.wire.block_size,
            metadata={
                "weight": str(int(weight)),
                "run_id": run_id,
                "final": str(final).lower(),
                "instance": self.instance,
            },
            owner=self._record(relay=True, **status),
        )
        self.last_round = round
        _LOG.info(
            f"relay: round {round} of {weight} nodes sent up in "
            f"{time.perf_counter() - started:.2f} s"
        )
        return self._wait(round, run_id, f"top-level global {round + 1}")

    def finish(self, state: RoundState) -> bool:
        """The group's run is over (maybe after a round not marked final): tell the top level,
        so its master stops waiting for this group (the group's global stays as it is)."""
        final = -1 if self.last_round is None else self.last_round
        self.store.claim_owner(
            self.node_id, self._record(relay=True, state="done", final_round=final)
        )
        _LOG.info(f"relay: group done after round {final}; told the top level")
        return False


# -- the quantized outer step (global_dtype int8/int4) ------------------------------------
@torch.no_grad()
def step_quantized(
    optimizer: NesterovOuterOptimizer,
    state: dict[str, torch.Tensor],
    mean: Mapping[str, torch.Tensor],
    residual: dict[str, torch.Tensor],
    *,
    dtype: str,
    block_size: int,
    error_feedback: bool,
) -> OuterUpdate:
    """The outer step of ``optimizer`` on ``state`` (in place, a tensor at a time), its update
    quantized: ``state`` ends as ``add_decoded(previous, decode(sent))``; ``residual`` (in
    place) keeps what ``sent`` left out when ``error_feedback``."""
    bits = QUANTIZED_BITS[dtype]
    base_digest = state_digest(state)
    encoded: dict[str, QuantizedTensor] = {}
    for key in mean:
        weight = state[key]
        if not weight.is_floating_point():
            continue
        previous = weight.detach().clone()
        optimizer.step({key: weight}, {key: mean[key]})
        update = weight.to(torch.float32) - previous.to(torch.float32)
        if key in residual:
            update.add_(residual[key])
        sent = quantize(update, bits, block_size)
        decoded = sent.dequantize()
        if error_feedback:
            residual[key] = update.sub_(decoded)
        weight.copy_(add_decoded(previous, decoded))
        encoded[key] = sent
    return OuterUpdate(encoded, dtype, block_size, -1, base_digest)
