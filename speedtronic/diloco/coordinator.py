"""The wiring: builds a node's round, the master's round and the store from the config.

The trainer sees one object (its ``SyncCoordinator``): it attaches it to the inner optimizer
and calls ``start`` / ``finish`` (the run reached its target) / ``stop``. The rounds live in
:mod:`.node` and :mod:`.master`; this module builds them and the store (:func:`build_transport`)
from the ``distributed`` section and owns the order of startup, the end of the run,
``final/`` (:func:`write_final`), the checkpointed state, a group leader's relay to the
top-level exchange (:class:`~.master.RelayStep`) and the one ``emit(event, **fields)`` every
DiLoCo class reports through, handed to the metrics logger. The token appears in no event
and, while the coordinator runs, in no line of the ``speedtronic.diloco`` logger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle

from speedtronic.background import Loop, wait_for
from speedtronic.checkpoint import atomic_json_dump, atomic_write_bytes
from speedtronic.config import DistributedConfig, SpeedtronicConfig
from speedtronic.diloco import codec
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import (
    ExchangeError,
    RoundSettings,
    Store,
    max_global_bytes,
    scrub,
)
from speedtronic.diloco.hub import HubClient
from speedtronic.diloco.link import NodeClaim, NodeLink, resolve_node_id
from speedtronic.diloco.master import RelayStep, RoundMaster, RoundsStalledError, Score
from speedtronic.diloco.node import Contribution, DiLoCoNode, GlobalCandidate, GlobalInbox
from speedtronic.retry import RetryPolicy, retry_policy_from_config

__all__ = [
    "DumbDiLoCoCoordinator",
    "RoundsStalledError",
    "build_transport",
    "write_final",
]

_LOG = logging.getLogger("speedtronic.diloco")

# finish() waits for the master's final global while rounds close; with no new global for
# (drop_after + 2) round lengths plus this margin, the rounds stalled (RoundsStalledError)
STALL_MARGIN_S = 60.0


class EventSink(Protocol):
    """Where the coordinator's events go: the metrics logger's ``emit(event, payload)``."""

    def emit(self, event: str, payload: dict[str, object]) -> None: ...


class _LogLines:
    """The :class:`EventSink` without a metrics logger: one line per event on ``logger``."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def emit(self, event: str, payload: dict[str, object]) -> None:
        self.logger.info("%s %s", event, payload)


class _ScrubToken(logging.Filter):
    """Replaces the token, in every form it can take (:func:`scrub`), in each line."""

    def __init__(self, token: str | None) -> None:
        super().__init__()
        self.secrets = (token,)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def _distributed_section(
    config: DistributedConfig | SpeedtronicConfig | Mapping[str, object],
) -> DistributedConfig:
    """The ``distributed`` section of a whole config, a mapping of one (2.0.0: a root
    config), or the section itself."""
    if isinstance(config, DistributedConfig):
        return config
    if isinstance(config, SpeedtronicConfig):
        return config.distributed
    root = config if "distributed" in config else {"distributed": dict(config)}
    return SpeedtronicConfig.from_dict(root).distributed


class DumbDiLoCoCoordinator:
    """One node's DiLoCo participation. Roles: ``worker`` trains and contributes; ``master``
    also runs the master's round (and trains unless ``distributed.train`` is false).

    ``config`` is the ``distributed`` section (or a whole config); ``hub`` the store (default:
    :func:`build_transport`); ``logger`` gets the events (a ``logging.Logger``, by default
    ``speedtronic.diloco``, one line each); ``state_dir`` + node id holds the local state;
    ``evaluate(state)`` scores a global (master only); ``final_dir`` receives
    :func:`write_final` with ``run_config``, the redacted config; ``resumable``: a stop
    leaves a checkpoint this node can resume from (its leave record says so)."""

    def __init__(
        self,
        config: DistributedConfig | SpeedtronicConfig | Mapping[str, object],
        model: torch.nn.Module,
        *,
        hub: Store | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        logger: EventSink | logging.Logger | None = None,
        environ: Mapping[str, str] | None = None,
        evaluate: Callable[[dict[str, torch.Tensor]], Score | None] | None = None,
        final_dir: str | os.PathLike[str] | None = None,
        run_config: Mapping[str, object] | None = None,
        resumable: bool = False,
    ) -> None:
        self.config = cfg = _distributed_section(config)
        self.model = model
        if logger is None or isinstance(logger, logging.Logger):
            logger = _LogLines(logger or _LOG)
        self.logger: EventSink = logger
        self._scrubber = _ScrubToken(cfg.token)
        environ = environ or os.environ
        self.node_id = resolve_node_id(cfg.node_id, environ)
        self.role: str = cfg.node_role
        self.trains = cfg.train or self.role != "master"
        self.store = hub = self._wired(hub)
        self.state_dir = Path(state_dir or cfg.state_dir) / self.node_id
        self.state_dir.mkdir(parents=True, exist_ok=True)
        host = environ.get("HOSTNAME") or None  # a container's or pod's name
        self.claim = NodeClaim(self.node_id, self.role, self.state_dir, host=host)
        self._interrupted = threading.Event()
        self._halt = threading.Event()  # set at stop(): a relay waiting for the top level ends
        self.settings = RoundSettings.of(cfg)  # read once, handed to every part
        # a master's own node hands its contributions over on this disk, not the exchange
        own = self.state_dir.resolve() / "own"
        self.own = DirectoryTransport(own.as_uri(), hub.retry) if self.role == "master" else None
        self.link = self._link(hub, model)
        self.final_dir = Path(final_dir) if final_dir is not None else None
        self.run_config = dict(run_config or {})
        self.inbox = GlobalInbox(
            None if self.role == "master" else self.link.fetch,
            interval=cfg.poll_interval,
            threaded=cfg.async_global_poll,
        )
        self.node = self._node(model) if self.trains else None
        self.master = self._master(hub, model, evaluate) if self.role == "master" else None
        self._prepared: Mapping[str, object] | None = None
        self._prepared_step: int | None = None  # the node's step in the applied checkpoint
        self._resumed = False  # a checkpoint with this coordinator's state was applied
        self._run_ended: str | None = None  # why this node has no run to take part in
        self._master_hook: RemovableHandle | None = None  # raises the master's fatal error
        self._global_at = time.monotonic()  # when the last global was handed to this process
        self._longest_round = 0.0  # the longest time between two globals seen here
        self._started = False
        self._ready = False
        self._beat = time.monotonic()
        self.resumable = resumable
        self._beats = self._beat_loop()

    def _wired(self, hub: Store | None) -> Store:
        """The store (built from the config when none is given) with this coordinator's
        retry reporting."""
        if hub is None:
            return build_transport(self.config, self._retry_policy())
        if hub.retry.on_retry is None:
            hub.retry.on_retry = self._on_retry
        return hub

    def _beat_loop(self) -> Loop | None:
        """A worker's liveness beat every ``heartbeat_interval``: on a shared directory a
        beat each time; on the Hub, where a beat is a commit, a listing each time and a beat
        only when the others wait for this node (docs/diloco.md "Liveness")."""
        rules = self.settings.rules
        if self.role == "master" or rules.liveness_timeout <= 0:
            return None
        self.claim.beats = True  # the master holds it to its beat

        def tick() -> None:
            if self.store.kind == "directory":
                self.link.send_beat()
            elif self.node is not None:
                self.link.beat_if_waited(self.node.rounds.next_round())

        return Loop("speedtronic-diloco-beat", tick, rules.heartbeat_interval)

    def _retry_policy(self) -> RetryPolicy:
        retry = retry_policy_from_config(self.config)
        retry.on_retry = self._on_retry
        return retry

    def _link(self, hub: Store, model: torch.nn.Module) -> NodeLink:
        """This node's link to the exchange; a global must fit ``model``'s shapes and dtypes,
        within the master's own bound for the same file."""
        like = model.state_dict()
        return NodeLink(
            hub,
            self.settings,
            claim=self.claim,
            max_bytes=max_global_bytes(like),
            like=like,
            interrupted=self._interrupted,
            emit=self._emit,
            secrets=(self.config.token,) if self.config.token else (),
            own=self.own,
        )

    def _node(self, model: torch.nn.Module) -> DiLoCoNode:
        """This node's round over ``model``, sending through the link, fed by the inbox."""
        on_master = self.config.role == "master"
        send, inbox, emit = self._send, self.inbox, self._emit
        return DiLoCoNode(
            self.settings, model, send=send, inbox=inbox, emit=emit, on_master=on_master
        )

    def _master(
        self,
        hub: Store,
        model: torch.nn.Module,
        evaluate: Callable[[dict[str, torch.Tensor]], Score | None] | None,
    ) -> RoundMaster:
        """The master's round over ``model``'s weights; a group leader's (``relay_to``)
        relays its rounds to the top-level exchange and scores nothing."""
        cfg = self.config
        return RoundMaster(
            hub,
            codec.cpu_state_dict(model.state_dict()),
            settings=self.settings,
            state_dir=self.state_dir,
            emit=self._emit,
            on_global=self._offer,
            evaluate=None if cfg.relay_to else evaluate,
            on_final=self._write_final,
            outer=self._relay(cfg.relay_to) if cfg.relay_to else None,
            own=self.own,
        )

    def _relay(self, top: str) -> RelayStep:
        """A group leader's outer step: the relay to the top-level exchange ``top`` (same
        token)."""
        top_level = dataclasses.replace(self.config, repo_id=top, relay_to=None)
        store = build_transport(top_level, self._retry_policy())
        return RelayStep(
            store,
            node_id=self.node_id,
            settings=self.settings,
            record=self.claim.record,
            stop=self._halt,
        )

    # -- reporting ---------------------------------------------------------------------------
    def _emit(self, event: str, /, **fields: object) -> None:
        """The one ``emit``: string fields scrubbed of the token, to ``logger.emit``."""
        secrets = self._scrubber.secrets
        clean = {k: scrub(v, secrets) if isinstance(v, str) else v for k, v in fields.items()}
        self.logger.emit(event, clean)

    def _on_retry(self, operation: str, attempt: int, error: str) -> None:
        self._emit(
            "transport_retry",
            operation=operation.split(" ")[0],
            detail=operation,
            attempt=attempt,
            error=error,
        )

    # -- read-only state ---------------------------------------------------------------------
    @property
    def outer_step(self) -> int:
        """The newest outer step this process knows (published or installed)."""
        if self.master is not None:
            return self.master.outer_step
        return max(self.last_global_step, 0)

    @property
    def last_global_step(self) -> int:
        """Outer step of the global installed in the local model (-1: none yet)."""
        installed = self.node.rounds.installed if self.node is not None else None
        return -1 if installed is None else installed

    @property
    def local_step(self) -> int:
        """Optimizer steps this node applied (absolute)."""
        return self.node.step if self.node is not None else 0

    @property
    def last_heartbeat(self) -> float:
        """``time.monotonic()`` of the last sign of life (also while waiting for a global)."""
        node = self.node.last_heartbeat if self.node is not None else 0.0
        return max(node, self._beat, self.link.beat)

    @property
    def run_ended(self) -> str | None:
        """Why this node has no run (left) to take part in, else None: it arrived after the
        final global, or the master published the final global while this node still had
        steps to train (it was dropped). The trainer stops with this reason (exit 0)."""
        node = self.node
        if self._run_ended is not None or self.master is not None or node is None:
            return self._run_ended
        if node.end.final_seen and not node.end.finishing:
            self._end_run(
                f"the master published the final global of this run (outer step "
                f"{node.rounds.installed}) while this node still had steps to train; they would "
                "never be aggregated, so it stops here"
            )
        return self._run_ended

    def membership(self) -> tuple[int, dict[str, float]] | None:
        """Master: the nodes the open round waits for and the seconds since each training
        node was last seen (``/metrics``); None elsewhere."""
        return self.master.membership() if self.master is not None else None

    def is_ready(self) -> bool:
        """Master: after startup. Worker: once a global is installed."""
        return self._ready

    # -- wiring and lifecycle ----------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer, *, hook: bool = True) -> None:
        """Run the node's round after every applied ``optimizer.step()``; ``hook=False``: the
        caller runs it with :meth:`round_step` (a sharded node, whose ``model`` is a copy)."""
        if self.node is not None:
            self.node.attach(optimizer) if hook else self.node.bind(optimizer)
        if self.master is not None and hook:
            if self._master_hook is not None:
                self._master_hook.remove()
            self._master_hook = optimizer.register_step_post_hook(
                lambda *_: self._raise_master_fatal()
            )

    def _raise_master_fatal(self) -> None:
        """The master thread met an error no retry fixes (it stopped): end the process."""
        fatal = self.master.fatal if self.master is not None else None
        if fatal is not None:
            self.link.raise_if_permanent(fatal, "the master cannot use the exchange")
            raise fatal

    def wants_weights(self) -> bool:
        """Whether the next :meth:`round_step` reads or writes ``model`` (see
        :meth:`DiLoCoNode.wants_weights`)."""
        return self.node is not None and self.node.wants_weights()

    def round_step(self, *, weights_current: bool) -> bool:
        """One applied inner step when not hooked on the optimizer; True when a global was
        merged into ``model``."""
        self._raise_master_fatal()
        if self.node is None:
            return False
        return self.node.after_optimizer_step(weights_current=weights_current)

    def after_optimizer_step(self, model: torch.nn.Module, step: int) -> bool:
        """2.0.0 per-step call for a coordinator that is not attached to an optimizer."""
        if model is not self.model:
            raise ValueError("coordinator is attached to a different model")
        if self.node is None or self.node.optimizer is not None:
            return False
        return self.node.after_optimizer_step()

    def interrupt(self) -> None:
        """A stop was requested: waits for globals end early (safe from signal handlers)."""
        self._interrupted.set()
        if self.node is not None:
            self.node.interrupted.set()

    def start(self, step: int | None = None) -> None:
        """Claim the node id, set up the repository (master) and install the first global."""
        if self._started:
            return
        if self._scrubber not in _LOG.filters:
            _LOG.addFilter(self._scrubber)  # removed at stop()
        pending = self._apply_prepared()
        node = self.node
        if node is not None and step is not None and self._prepared_step is None:
            node.step = int(step)
        with self._quick_retries():  # an outage must not hold training at startup
            if self.master is not None:
                self._start_master(self.master, step)
            elif node is not None and not self._join_run(node):
                self._started = True  # the run ended without this node
                return
        if node is not None:
            if node.may_merge():  # start the round from the current global
                node.merge_waiting()
            self._ready = self._ready or node.rounds.installed is not None
            if pending is not None:
                node.uploads.submit(pending)
        self.inbox.start()
        if self.master is not None:
            self.master.start()
        if node is not None:  # its first round begins with training, after the start's waits
            node.clock.restart()
        if self._beats is not None:
            self._beats.start()
        self._started = True
        installed = self.last_global_step
        _LOG.info(
            f"DumbDiLoCo started role={self.role} node_id={self.node_id} "
            f"global_step={installed} sync={self.config.sync}"
        )
        self._emit("diloco_started", role=self.role, node_id=self.node_id, global_step=installed)

    def _join_run(self, node: DiLoCoNode) -> bool:
        """A worker claims its id only once it found a run to take part in (False: none)."""
        self.link.check_id()  # a live process here with our id: exit 2 before waiting
        rounds = node.rounds
        candidate, ended = self.link.first_global(rounds.run_id, rounds.installed is not None)
        if ended:
            self._end_run(ended)
            return False
        if candidate is not None:
            self.inbox.offer(candidate)
        self.link.claim_id(**self._status())
        return True

    def _start_master(self, master: RoundMaster, step: int | None) -> None:
        """Create the exchange (private), claim the id, grant access, agree with the exchange.
        Only a master from scratch starts a new run (over a finished one): not after a trained
        step, a checkpoint with coordinator state, or (a pure aggregator, always at step 0)
        with a local outer state of its own (it served a run)."""
        agreement = master.agreement
        agreement.fresh = not (step or self._resumed) and (
            self.trains or not agreement.has_local_state
        )
        try:
            self.store.create_repo(private=True)
        except Exception as exc:
            self.link.raise_if_permanent(exc, "cannot create the exchange")
            agreement.exchange_created = False  # the master's thread creates it later
            _LOG.warning(
                f"master repository initialization failed; continuing (retried at every "
                f"poll): {exc}"
            )
        self.link.claim_id(**self._status())
        for name in self.config.collaborators:
            try:
                self.store.add_collaborator(name, permission="write")
            except Exception as exc:
                _LOG.warning(f"could not grant write access to {name}: {exc}")
        try:
            master.reconcile(announce=True)
        except ExchangeError:
            raise  # an unusable exchange (e.g. a corrupt global and no local state): exit 2
        except Exception as exc:
            self.link.raise_if_permanent(exc, "cannot use the exchange")
            _LOG.warning(f"master could not reconcile with the repository yet: {exc}")
        self._ready = True

    def _status(self) -> dict[str, object]:
        """The status record this node claims its id with at startup."""
        if self.node is not None and self.node.end.done:  # resumed after its last contribution
            last = self.node.rounds.last_round
            return {"state": "done", "final_round": -1 if last is None else last}
        return {"state": "training" if self.trains else "aggregator"}

    @contextlib.contextmanager
    def _quick_retries(self) -> Iterator[None]:
        """At most two attempts per call during startup; the threads retry fully later."""
        retry = self.store.retry
        saved, retry.attempts = retry.attempts, min(retry.attempts, 2)
        try:
            yield
        finally:
            retry.attempts = saved

    def _end_run(self, why: str) -> None:
        """This node has no run to take part in: one line, and the trainer stops (exit 0)."""
        self._run_ended = why
        _LOG.warning(why)
        self._emit("diloco_run_ended", node_id=self.node_id, reason=why)

    def finish(self) -> None:
        """The run reached its target: the node's last contribution and ``done`` status; the
        master serves rounds until every node is done or dropped, then installs the final
        global."""
        if self.node is not None:
            self.node.finish()
            self._ready = self._ready or self.node.rounds.installed is not None
        if self.master is not None:
            self._serve_until_final(self.master)
            if self.node is not None:
                self.node.merge_waiting()
            elif self.master.finished.is_set():
                self.model.load_state_dict(
                    codec.cpu_state_dict(self.master.global_state), strict=False
                )

    def _serve_until_final(self, master: RoundMaster) -> None:
        """Wait while the master's rounds go on until it published the final global.

        The bound counts from the last progress (a global handed to this process, or the
        master's ``last_progress``: a contribution, a status change, a closed round), not from
        the last global: a round may be slow, workers may start late. With none for
        ``drop_after + 2`` times the longer of ``round_timeout`` and the longest round, plus
        ``STALL_MARGIN_S`` (a silent node is dropped after ``drop_after`` rounds), it is a
        :class:`RoundsStalledError`. A fatal error of the master's thread is raised too."""
        cfg, started = self.config, time.monotonic()

        def over() -> bool:
            if master.finished.is_set() or self._interrupted.is_set():
                return True
            self._raise_master_fatal()
            now = self._beat = time.monotonic()
            progress = max(self._global_at, master.last_progress)
            bound = (cfg.drop_after + 2) * max(cfg.round_timeout, self._longest_round)
            bound += STALL_MARGIN_S
            if now - progress > bound:
                raise RoundsStalledError(
                    f"the master waited {now - started:.0f} s for its final global and saw no "
                    f"progress (no contribution, node status change or closed round) in the "
                    f"last {now - progress:.0f} s (bound {bound:.0f} s: distributed.drop_after "
                    "+ 2 rounds of distributed.round_timeout or the longest round, plus "
                    f"{STALL_MARGIN_S:.0f} s); its state is saved, a restart with --resume "
                    "serves the open rounds again"
                )
            return False

        wait_for(over, timeout=None, interval=0.5, stop=master.finished)
        self._raise_master_fatal()

    def stop(self) -> None:
        """Let an upload in flight finish (bounded), stop the threads; a worker that leaves
        before its run ended says so on the exchange (the master stops waiting for it)."""
        if self.node is not None and not self.node.stop():
            _LOG.warning("an upload was still in flight at stop; it is in the checkpoint")
        if self._beats is not None:
            self._beats.stop(self.config.delta_upload_shutdown_timeout)
        if self._leaving():
            with self._quick_retries():  # bounded: the stop must fit the grace period
                self.link.leave(resume=self.resumable)
        self.inbox.stop(self.config.delta_upload_shutdown_timeout)
        if self.master is not None:
            self._halt.set()
            self.master.stop()
        self._started = False
        _LOG.removeFilter(self._scrubber)

    def _leaving(self) -> bool:
        """A started worker stops before its run ended (a SIGTERM, a scale-down, a crash)."""
        node = self.node
        if not self._started or self.master is not None or node is None:
            return False
        return not (node.end.done or node.end.final_seen or self._run_ended)

    def _send(self, job: Contribution) -> int:
        """The node's upload (see :meth:`NodeLink.send`); a local master looks at once."""
        nbytes = self.link.send(job)
        if self.master is not None:
            self.master.wake()
        return nbytes

    def _offer(self, outer_step: int, state: dict[str, torch.Tensor]) -> None:
        now = time.monotonic()
        self._longest_round = max(self._longest_round, now - self._global_at)
        self._global_at = now
        run_id = self.master.run_id if self.master is not None else ""
        candidate = GlobalCandidate(outer_step, state, run_id=run_id)
        moments = self.master.moments if self.master is not None else None
        if moments is not None and moments[0] == outer_step:
            candidate.moments = moments[1], moments[2]
        self.inbox.offer(candidate)

    def _write_final(self, outer_step: int, state: dict[str, torch.Tensor]) -> None:
        """``final/``: the final global, the redacted config and what produced it; with
        ``final_average`` > 1 (a mean, not the last global) offered to the local node too."""
        if self.config.final_average > 1 and self.master is not None:
            copy = codec.cpu_state_dict(state)
            final = GlobalCandidate(outer_step, copy, final=True, run_id=self.master.run_id)
            self.inbox.offer(final)
        if self.final_dir is None:
            return
        meta = {
            "outer_step": outer_step,
            "step": self.settings.rules.steps_behind(outer_step),  # node steps behind it
            "node_id": self.node_id,
            "ledger": dict(sorted(self.master.ledger.items())) if self.master else {},
        }
        write_final(self.final_dir, state, meta=meta, run_config=self.run_config)
        self._emit("diloco_final", outer_step=outer_step, path=str(self.final_dir))

    # -- checkpointed state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """The node's round state (the master keeps its own in ``state_dir``)."""
        return {
            "node_id": self.node_id,
            "role": self.role,
            "node": self.node.state_dict() if self.node is not None else None,
            "outer": self.master.state_dict() if self.master is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore checkpointed state (applied at ``start()`` when not started yet)."""
        self._prepared = dict(state)
        if self._started:
            pending = self._apply_prepared()
            if pending is not None and self.node is not None:
                self.node.uploads.submit(pending)

    def _apply_prepared(self) -> Contribution | None:
        state, self._prepared = self._prepared or {}, None
        node_state = state.get("node")
        if state.get("outer") or node_state:
            self._resumed = True  # the run this state belongs to goes on
        if self.node is None or not node_state or not isinstance(node_state, Mapping):
            return None
        pending = self.node.load_state_dict(node_state)
        self._prepared_step = self.node.step
        return pending


def build_transport(
    config: DistributedConfig, retry: RetryPolicy | None = None
) -> DirectoryTransport | HubClient:
    """``file:///abs`` -> :class:`DirectoryTransport`; ``owner/name`` -> :class:`HubClient`
    (``retry`` overrides the section's policy). A Hub repository that answers "not found" is
    one its master has not created yet for ``round_timeout`` seconds (what a worker waits for
    the first global), then one the token cannot see (a permanent ``AccessRefused``)."""
    retry = retry or retry_policy_from_config(config)
    repo_id = config.repo_id or ""
    if repo_id.startswith("file:"):
        return DirectoryTransport(repo_id, retry)
    return HubClient(
        repo_id,
        token=config.token,
        cache_dir=config.cache_dir,
        retry=retry,
        missing_repo_wait=float(config.round_timeout),
    )


def write_final(
    directory: Path,
    state: Mapping[str, torch.Tensor],
    *,
    meta: Mapping[str, object],
    run_config: Mapping[str, object],
) -> None:
    """The final global as ``model.safetensors``, ``run_config`` (redacted) as
    ``config.yaml`` and ``meta`` (outer step, steps behind it, node, ledger) with the time it
    was written as ``meta.json``, each file written atomically."""
    import yaml

    codec.save_safetensors(dict(state), directory / "model.safetensors")
    atomic_write_bytes(
        yaml.safe_dump(dict(run_config), sort_keys=False).encode("utf-8"),
        directory / "config.yaml",
    )
    written = datetime.now(timezone.utc).isoformat()
    atomic_json_dump({**meta, "written_at": written}, directory / "meta.json")
