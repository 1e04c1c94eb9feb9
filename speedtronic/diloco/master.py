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
contributors (less the nodes that finished their run). Closing reads each file once (streaming:
one delta beside the running sum), averages each node's files, gives every node equal
weight, applies the Nesterov outer step, and publishes weights + ledger + the deletion of the
consumed files in one commit; then it persists ``outer_state`` locally, hands the global to
the local node, and evaluates it. When every node is done (their last contribution is in)
the master publishes the final global and calls ``on_final``.

Across restarts (:mod:`speedtronic.diloco.reconcile`): the master agrees with the published
state once before its first poll. Local state (:mod:`speedtronic.diloco.outer_state`): one
atomic file ``<state_dir>/outer_state.safetensors`` (global + momentum; the header holds the
outer step, run id, ledger and digests), and a write-ahead record of the round being
published, so a round the exchange holds is reported even when the master died before it
could say so. The ledger is also published, so a master with a lost disk never aggregates a
contribution twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.outer_state import OuterStateStore
from speedtronic.diloco.reconcile import META, MasterState
from speedtronic.diloco.roster import NodeView, Roster
from speedtronic.diloco.transport import RemoteNotFound, RepoScan, TransportError

__all__ = ["NodeView", "RoundMaster"]


_LOG = logging.getLogger("speedtronic.diloco")


class RoundMaster(MasterState):
    """Aggregates one contribution per node per round into the published global.

    ``settings`` is the ``distributed`` config section; ``state`` the initial global (the
    model's weights, used only to bootstrap an empty repository). ``on_global(step, state)``
    receives every new global (the local node's inbox); ``evaluate(state)`` returns an
    object with ``loss``, ``perplexity``, ``tokens`` (or None); ``on_final(step, state)``
    runs once after the final global was published.
    """

    def __init__(
        self,
        transport: Any,
        state: Mapping[str, torch.Tensor],
        *,
        settings: Any,
        state_dir: str | os.PathLike,
        emit: Callable[[str, dict[str, Any]], None],
        log: Any = None,
        on_global: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        evaluate: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        on_final: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        upstream: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.hub = transport
        self.settings = settings
        self.global_state = T.cpu_state_dict(state)
        self._initial = T.cpu_state_dict(state)  # the global of a new run
        self.fresh = False  # set by a master that starts its training from step 0
        self.state_dir = Path(state_dir)
        self.store = OuterStateStore(state_dir)
        self.outer_step = 0
        self.ledger: dict[str, int] = {}
        self.run_id = ""  # names this run in every global and contribution
        self.digests: dict[str, str] = {}  # node -> sha256 of its last aggregated contribution
        self.optimizer = self._new_optimizer()
        self._emit = emit
        self._log = log or _LOG
        self.roster = Roster(lambda node_id: self.hub.read_owner(node_id), emit, self._log)
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
        self._blind_since: float | None = None  # when the exchange became unreadable
        self._round_seconds = 0.0  # moving average of round lengths
        self._prune: set[str] = set()
        self._reset_tally()
        self._pending_digests: dict[str, str] = {}  # of the round being closed
        self.has_local_state = False
        self.local_state_corrupt = False
        self.reconciled = False
        self._handed: int | None = None  # the outer step last given to on_global
        self._load_local_state()

    def _reset_tally(self) -> None:
        """Start counting the open round's refused files afresh (after a close)."""
        self._counts = {"stale": 0, "skipped": 0, "corrupt": 0}
        self._dropped: list[str] = []  # "node/round" of stale contributions since the last close

    def _tally(self) -> dict[str, Any]:
        """The refused files since the last close, as ``outer_step`` and ``final_global``
        report them."""
        counts = {f"deltas_{kind}": count for kind, count in self._counts.items()}
        return {**counts, "dropped": list(self._dropped)}

    # -- one poll ---------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Scan the repository and close the open round when it is due; True if it closed."""
        now = self._clock()
        try:
            if not self.reconciled:  # at start, and again after a publish that failed
                self.reconcile()
            scan = self.hub.scan()
        except TransportError:
            if self._blind_since is None:
                self._blind_since = now
            raise
        self._credit_blind_time(now)
        self.roster.refresh(scan, now, self.outer_step)
        candidates = self._sort_contributions(scan, now)
        limit = self.settings.drop_after * max(self.settings.round_timeout, self._round_seconds)
        active = self.roster.active(now, limit, self.ledger)
        reason = self._close_reason(now, active, candidates)
        if reason is not None and self._close(candidates, reason, active, now):
            return True
        if self._prune:  # refused, duplicate or stale files go now, before they are re-sent
            self._flush_prune()
        if (
            self.roster.run_over(active, self.ledger)
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

    @property
    def nodes(self) -> dict[str, NodeView]:
        """The nodes of this exchange, by id (see :class:`~speedtronic.diloco.roster.Roster`)."""
        return self.roster.nodes

    def _sort_contributions(self, scan: RepoScan, now: float) -> dict[str, dict[int, str]]:
        """Includable files ``{node: {round: path}}``; duplicates and stale ones are queued
        for pruning and counted."""
        open_round = self.outer_step
        oldest = open_round - self.settings.max_staleness
        candidates: dict[str, dict[int, str]] = {}
        for node_id, files in scan.deltas.items():
            done = self.ledger.get(node_id, -1)
            for label, path in sorted(files.items()):
                if path in self._prune:
                    continue
                if label <= done:
                    self._prune.add(path)
                    self._counts["skipped"] += 1
                elif label < oldest:
                    self._prune.add(path)
                    self._counts["stale"] += 1
                    self._dropped.append(f"{node_id}/{label}")
                    self.ledger[node_id] = max(self.ledger.get(node_id, -1), label)
                    self._log.warning(
                        f"dropping the contribution of {node_id} to round {label}: "
                        f"{open_round - label} rounds late (max_staleness "
                        f"{self.settings.max_staleness})"
                    )
                elif label <= open_round:
                    size = scan.size(path)
                    if size is not None and size > self.max_delta_bytes:
                        self._refuse(path, f"{size} bytes, more than a delta of this model")
                        continue
                    candidates.setdefault(node_id, {})[label] = path
                    self._heard(node_id, now)
        return candidates

    @property
    def max_delta_bytes(self) -> int:
        """The largest delta file this model can produce (float32 values + a header)."""
        values = sum(v.numel() for v in self.global_state.values() if v.is_floating_point())
        return 4 * values + (1 << 20)

    def _refuse(self, path: str, why: str) -> None:
        """A contribution file that cannot be used: counted corrupt and pruned unread."""
        self._prune.add(path)
        self._counts["corrupt"] += 1
        self._log.warning(f"dropping delta {path}: {why}")

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
        need = max(1, self.settings.min_nodes - self.roster.finished_count(self.ledger))
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
        self,
        candidates: Mapping[str, Mapping[int, str]],
        reason: str,
        active: set[str],
        now: float,
    ) -> bool:
        started = time.perf_counter()
        self._pending_digests = {}
        total = {
            k: torch.zeros(tuple(v.shape), dtype=torch.float32)
            for k, v in self.global_state.items()
            if v.is_floating_point()
        }
        weight = 0
        included: list[str] = []
        consumed: list[str] = []
        marks: dict[str, int] = {}
        late = 0
        for node_id in sorted(candidates):
            used, node_weight = self._fold_node(candidates[node_id], total)
            weight += node_weight
            for label, path in used:
                included.append(f"{node_id}/{label}")
                consumed.append(path)
                late += label < self.outer_step
                marks[node_id] = max(marks.get(node_id, -1), label)
        if not marks:
            return False
        for value in total.values():
            value.div_(float(weight))
        with self._lock:
            saved = (
                self.outer_step,
                dict(self.ledger),
                T.cpu_state_dict(self.global_state),
                self.optimizer.state_dict(),
            )
            for node_id, label in marks.items():
                self.ledger[node_id] = max(self.ledger.get(node_id, -1), label)
            final = self.roster.run_over(self.roster.waiting(self.ledger), self.ledger)
        if not self._step(total, weight, final, saved):
            for path in consumed:
                self._refuse(path, "the outer step would make the global non-finite")
            return False
        report = {
            "outer_step": self.outer_step,
            "round": self.outer_step - 1,
            "reason": reason,
            "nodes_active": len(active),
            "nodes_included": len(marks),
            "deltas_found": len(consumed) + self._counts["corrupt"],
            "deltas_included": len(consumed),
            "deltas_late": late,
            "included": included,
            **self._tally(),
        }
        # written ahead: a kill after the exchange applied the publish and before the round
        # is reported below leaves this record, reported at the restart (outer_state.py)
        self.store.write_pending(self.outer_step, self.run_id, report)
        try:
            self.hub.publish_global(
                self.global_state,
                outer_step=self.outer_step,
                ledger=self.ledger,
                prune=sorted(set(consumed) | self._prune),
                metadata_extra=META,
                final=final,
                run_id=self.run_id,
            )
        except Exception:
            with self._lock:
                self.outer_step, self.ledger, self.global_state, momentum = saved
                self.optimizer.load_state_dict(momentum)
                # a publish that failed may still have landed: agree with the exchange again
                self.reconciled = False
            raise
        self._prune.clear()
        self.digests.update(self._pending_digests)
        self._pending_digests.clear()
        self._persist()
        opened, self._opened = self._opened, self._clock()
        length = self._opened - opened
        self._round_seconds = (
            length if not self._round_seconds else (0.7 * self._round_seconds + 0.3 * length)
        )
        self._first_arrival = None
        self._reset_tally()
        self._emit(
            "outer_step",
            {**report, "seconds": time.perf_counter() - started, "round_seconds": length},
        )
        self.store.clear_pending()
        self._after_publish(final)
        return True

    def _step(self, mean: dict[str, torch.Tensor], weight: int, final: bool, saved: tuple) -> bool:
        """The outer step on the round's ``mean``; a group leader relays it up instead and
        takes the top-level global that includes it. False (state restored) when the result
        would not be finite."""
        if self.upstream is not None:
            try:  # outside the lock: the wait for the top level may be long
                meta, state = self.upstream.forward(
                    mean, round_index=saved[0], weight=weight, run_id=self.run_id, final=final
                )
            except Exception:
                with self._lock:
                    self.ledger = saved[1]
                raise
            with self._lock:
                self._adopt(state, meta.outer_step)
                self.run_id = meta.run_id
            return True
        with self._lock:
            self.optimizer.step(self.global_state, mean)
            if T.first_non_finite(self.global_state) is not None:
                self.outer_step, self.ledger, self.global_state, momentum = saved
                self.optimizer.load_state_dict(momentum)
                return False
            self.outer_step += 1
        return True

    def _fold_node(
        self, files: Mapping[int, str], total: dict[str, torch.Tensor]
    ) -> tuple[list[tuple[int, str]], int]:
        """Add one node's valid files for this round into ``total`` as their mean times the
        node's weight (1, or the nodes a group leader speaks for), reading each file once,
        tensor by tensor. Returns the ``(round, path)`` used and the weight; unusable files
        are pruned and counted, and leave ``total`` untouched."""
        with contextlib.ExitStack() as stack:
            readers: list[tuple[int, str, T.DeltaReader, int]] = []
            for label, path in sorted(files.items()):
                try:
                    local = stack.enter_context(self.hub.local_copy(path))
                    reader = stack.enter_context(T.open_delta(local))
                    digest = reader.check(self.global_state)
                    weight = self._check_identity(path, reader.metadata, label)
                    if self.digests.get(path.split("/")[1]) == digest:
                        raise ValueError("the same values as its node's last contribution")
                except RemoteNotFound:
                    continue
                except TransportError:
                    raise  # an outage: the whole round is retried at the next poll
                except Exception as exc:
                    self._refuse(path, f"{type(exc).__name__}: {exc}")
                    continue
                run = reader.metadata.get("run_id", "")
                if run and self.run_id and run != self.run_id:  # computed in another run
                    self._prune.add(path)
                    self._counts["stale"] += 1
                    self._dropped.append(f"{path.split('/')[1]}/{label}")
                    self._log.warning(f"dropping {path}: it belongs to another run ({run})")
                    continue
                readers.append((label, path, reader, weight))
                self._pending_digests[path.split("/")[1]] = digest
            if not readers:
                return [], 0
            weight = max(w for _, _, _, w in readers)
            for _, _, reader, _ in readers:
                reader.add_to(total, scale=weight / len(readers))
            return [(label, path) for label, path, _, _ in readers], weight

    def _check_identity(self, path: str, header: Mapping[str, str], label: int) -> int:
        """A contribution must match its path, come from the node's current instance, and
        be based on a global this master published (``ValueError`` otherwise). Returns its
        weight: the number of nodes it speaks for (a group leader's sum; 1 for a node)."""
        node_id = path.split("/")[1]
        if header.get("node_id", node_id) != node_id or header.get("round", str(label)) != str(
            label
        ):
            raise ValueError("its header names another node or round than its path")
        base = int(header.get("base_outer_step", "0"))
        if not -1 <= base <= self.outer_step:  # -1: measured from the node's initial weights
            raise ValueError(f"based on outer step {base}, which this master never published")
        view = self.nodes.get(node_id)
        instance = header.get("instance")
        if view is not None and view.instance and instance and instance != view.instance:
            raise ValueError(f"written by instance {instance}, not the node's {view.instance}")
        weight = int(header.get("weight", "1"))
        if not 1 <= weight <= 1_000_000:
            raise ValueError(f"weight {weight} is not a number of nodes")
        return weight

    def _after_publish(self, final: bool) -> None:
        state = T.cpu_state_dict(self.global_state)
        self._hand_over(state)
        if self.evaluate is not None:
            result = self.evaluate(state)
            if result is not None:
                self._emit(
                    "eval",
                    {
                        "scope": "global",
                        "outer_step": self.outer_step,
                        "step": self.outer_step * self.settings.inner_steps,
                        "loss": result.loss,
                        "perplexity": result.perplexity,
                        "tokens": result.tokens,
                    },
                )
        if final:
            self._finalize(state)

    def _flush_prune(self) -> None:
        try:
            self.hub.prune(sorted(self._prune))
            self._prune.clear()
        except TransportError as exc:
            self._log.warning(f"could not prune consumed deltas: {exc}")

    def _finish(self) -> None:
        """Every node is done and nothing is left: mark the published global final (a group
        leader first tells the top level that its group is done)."""
        if self.upstream is not None:
            self.upstream.finish()
        self.hub.publish_global(
            self.global_state,
            outer_step=self.outer_step,
            ledger=self.ledger,
            metadata_extra=META,
            final=True,
            run_id=self.run_id,
        )
        # files refused after the last round (e.g. written once every node was done) are
        # reported here, or they would never be counted
        self._emit("final_global", {"outer_step": self.outer_step, **self._tally()})
        self._reset_tally()
        self._finalize(T.cpu_state_dict(self.global_state))

    def _finalize(self, state: dict[str, torch.Tensor]) -> None:
        if self.on_final is not None:
            self.on_final(self.outer_step, state)
        self._log.info(f"final global published at outer step {self.outer_step}")
        self.finished.set()

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Run :meth:`poll_once` on a daemon thread until stopped or finished."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, name="speedtronic-diloco-master", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set() and not self.finished.is_set():
            try:
                closed = self.poll_once()
            except TransportError as exc:
                self._log.warning(f"master round failed; retrying at the next poll: {exc}")
                closed = False
            except Exception as exc:  # never let the aggregation thread die silently
                self._log.error(f"master round error: {type(exc).__name__}: {exc}")
                closed = False
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
