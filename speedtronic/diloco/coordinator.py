"""DumbDiLoCo coordinator: assembles a node's round, the master's round and the transport.

The trainer sees one object (its ``SyncCoordinator``): it attaches it to the inner optimizer
and calls ``start`` / ``finish`` (the run reached its target) / ``stop``. What happens in a
round lives in two modules: :mod:`.node` (the node side, hooked on ``optimizer.step``) and
:mod:`.master` (the master's round, on its own thread). This module builds them from the
``distributed`` config section, owns the node's identity claim and status record, the
startup (repository, first global), the final directory, and the checkpointed state.

Roles: ``worker`` trains and contributes; ``master`` also runs the master's round (and trains
unless ``distributed.train`` is false, which makes it a pure aggregator).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from speedtronic.checkpoint import atomic_write_bytes
from speedtronic.diloco import tensors as T
from speedtronic.diloco.exchange import build_transport
from speedtronic.diloco.identity import (
    ExchangeAccessError,
    NodeClaim,
    NodeIdCollisionError,
    resolve_node_id,
)
from speedtronic.diloco.mailbox import Contribution, GlobalCandidate, GlobalInbox
from speedtronic.diloco.master import RoundMaster
from speedtronic.diloco.node import DiLoCoNode
from speedtronic.diloco.relay import Upstream
from speedtronic.diloco.retry import (
    AccessRefused,
    ExchangeError,
    TransportError,
    retry_policy_from_config,
    scrub,
)

__all__ = [
    "DumbDiLoCo",
    "DumbDiLoCoCoordinator",
    "RoundsStalledError",
    "build_transport",
    "resolve_node_id",
]

_LOG = logging.getLogger("speedtronic.diloco")

# finish() waits for the master's final global while rounds close; with no new global for
# (drop_after + 2) round lengths plus this margin, the rounds stalled (RoundsStalledError)
STALL_MARGIN_S = 60.0


def _distributed_section(config: Any) -> Any:
    from speedtronic.config import DistributedConfig, SpeedtronicConfig

    if isinstance(config, Mapping):
        if "distributed" in config:
            return SpeedtronicConfig.from_dict(dict(config)).distributed
        return DistributedConfig(**dict(config))
    if isinstance(config, SpeedtronicConfig):
        return config.distributed
    return config


class RoundsStalledError(RuntimeError):
    """The master's rounds made no progress for longer than any round may take (exit 1: a
    restart resumes them)."""


class DumbDiLoCoCoordinator:
    """One node's DiLoCo participation (see the module docstring).

    ``config`` is the ``distributed`` section (or a whole config); ``hub`` a transport (built
    from ``repo_id`` when None); ``state_dir`` the base of this node's local state (the node id
    is appended). ``evaluate(state)`` scores a global (master only); ``final_dir`` receives the
    final global as ``model.safetensors`` + ``config.yaml`` + ``meta.json``; ``run_config``
    is the redacted config written there.
    """

    def __init__(
        self,
        config: Any,
        model: torch.nn.Module,
        *,
        hub: Any = None,
        state_dir: str | os.PathLike | None = None,
        logger: Any = None,
        environ: Mapping[str, str] | None = None,
        evaluate: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        final_dir: str | os.PathLike | None = None,
        run_config: Mapping[str, Any] | None = None,
    ):
        self.config = cfg = _distributed_section(config)
        self.model = model
        self.logger = logger if logger is not None else _LOG
        self._token = cfg.token
        self.node_id = resolve_node_id(cfg.node_id, environ or os.environ)
        self.role = cfg.role if cfg.role != "single" else ("master" if cfg.repo_id else "worker")
        self.trains = cfg.train or self.role != "master"
        if hub is None:
            retry = retry_policy_from_config(cfg)
            retry.on_retry = self._on_retry
            hub = build_transport(cfg, retry)
        elif getattr(hub, "retry", None) is not None and hub.retry.on_retry is None:
            hub.retry.on_retry = self._on_retry
        self.hub = hub
        self.state_dir = Path(state_dir or cfg.state_dir) / self.node_id
        self.state_dir.mkdir(parents=True, exist_ok=True)
        host = (environ or os.environ).get("HOSTNAME") or None  # a container's or pod's name
        self.claim = NodeClaim(self.node_id, self.role, self.state_dir, host=host)
        self._displaced = ""  # the instance whose record this node took over at its claim
        self.final_dir = Path(final_dir) if final_dir is not None else None
        self.run_config = dict(run_config or {})
        self.inbox = GlobalInbox(
            None if self.role == "master" else self._fetch,
            interval=cfg.poll_interval,
            threaded=cfg.async_global_poll,
            say=self._say,
        )
        self.node = (
            DiLoCoNode(
                cfg, model, send=self._send, inbox=self.inbox, emit=self._emit, say=self._say
            )
            if self.trains
            else None
        )
        self.master: RoundMaster | None = None
        if self.role == "master":
            self._halt = threading.Event()
            self.master = RoundMaster(
                hub,
                T.cpu_state_dict(model.state_dict()),
                settings=cfg,
                state_dir=self.state_dir,
                emit=self._emit,
                log=self.logger,
                on_global=self._offer,
                evaluate=None if cfg.relay_to else evaluate,
                on_final=self._write_final,
                upstream=self._upstream(cfg) if cfg.relay_to else None,
            )
        self._prepared: Mapping[str, Any] | None = None
        self._refused = ""  # checksum of a published global this node refused
        self._run_ended: str | None = None  # why this node has no run to take part in
        self._master_hook: Any = None  # raises the master thread's fatal error on each step
        self._global_at = time.monotonic()  # when the last global was handed to this process
        self._longest_round = 0.0  # the longest time between two globals seen here
        self._started = False
        self._ready = False
        self._interrupted = threading.Event()
        self._beat = time.monotonic()

    def _upstream(self, cfg: Any) -> Upstream:
        """A group leader's relay to the top-level exchange ``relay_to`` (same token)."""
        retry = retry_policy_from_config(cfg)
        retry.on_retry = self._on_retry
        top = build_transport(dataclasses.replace(cfg, repo_id=cfg.relay_to, relay_to=None), retry)
        return Upstream(
            top,
            node_id=self.node_id,
            settings=cfg,
            record=self.claim.record,
            say=self._say,
            stop=self._halt,
        )

    # -- reporting ---------------------------------------------------------------------------
    def _emit(self, event: str, payload: dict[str, Any]) -> None:
        clean = {
            k: scrub(v, (self._token,)) if isinstance(v, str) else v for k, v in payload.items()
        }
        emit = getattr(self.logger, "emit", None)
        if callable(emit):
            emit(event, clean)
        else:
            self.logger.info("%s %s", event, clean)

    def _say(self, level: str, message: str) -> None:
        getattr(self.logger, level)(scrub(message, (self._token,)))

    def _on_retry(self, operation: str, attempt: int, error: str) -> None:
        self._emit(
            "transport_retry",
            {
                "operation": operation.split(" ")[0],
                "detail": operation,
                "attempt": attempt,
                "error": error,
            },
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
        return self.node.installed if self.node is not None else -1

    @property
    def local_step(self) -> int:
        """Optimizer steps this node applied (absolute)."""
        return self.node.step if self.node is not None else 0

    @property
    def last_heartbeat(self) -> float:
        """``time.monotonic()`` of the last sign of life (also while waiting for a global)."""
        node = self.node.last_heartbeat if self.node is not None else 0.0
        return max(node, self._beat)

    @property
    def run_ended(self) -> str | None:
        """Why this node has no run (left) to take part in, else None: it arrived after the
        final global, or the master published the final global while this node still had
        steps to train (it was dropped). The trainer stops with this reason (exit 0)."""
        node = self.node
        dropped = node is not None and node.final_seen and not node.finishing
        if self._run_ended is None and dropped and self.master is None:
            self._end_run(
                f"the master published the final global of this run (outer step "
                f"{node.installed}) while this node still had steps to train; they would "
                "never be aggregated, so it stops here"
            )
        return self._run_ended

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
        if self.master is not None and self.master.fatal is not None:
            self._fatal_if_permanent(self.master.fatal, "the master cannot use the exchange")
            raise self.master.fatal

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
        pending = self._apply_prepared()
        if self.node is not None and step is not None and self._prepared_step is None:
            self.node.step = int(step)
        if self.master is not None:  # a master starting from scratch starts a new run
            self.master.fresh = not step and self._prepared_step is None
        with self._quick_retries():  # an outage must not hold training at startup
            if self.master is not None:
                self._create_exchange()
                self._claim()
                self._start_master()
            else:  # a worker claims its id only once it found a run to take part in
                self._first_global()
                if self._run_ended is not None:
                    self._started = True
                    return
                self._claim()
        if self.node is not None:
            if self.node.may_merge():  # start the round from the current global
                self.node.merge_waiting()
            self._ready = self._ready or self.node.installed >= 0
            if pending is not None:
                self.node.uploads.submit(pending)
        self.inbox.start()
        if self.master is not None:
            self.master.start()
        self._started = True
        self._say(
            "info",
            f"DumbDiLoCo started role={self.role} node_id={self.node_id} "
            f"global_step={self.last_global_step} sync={self.config.sync}",
        )
        self._emit(
            "diloco_started",
            {"role": self.role, "node_id": self.node_id, "global_step": self.last_global_step},
        )

    @contextlib.contextmanager
    def _quick_retries(self) -> Iterator[None]:
        """At most two attempts per call during startup; the threads retry fully later."""
        retry = getattr(self.hub, "retry", None)
        saved = getattr(retry, "attempts", None)
        if saved is not None:
            retry.attempts = min(saved, 2)
        try:
            yield
        finally:
            if saved is not None:
                retry.attempts = saved

    def _create_exchange(self) -> None:
        """The master creates the repository (private) before anything is written to it."""
        try:
            self.hub.create_repo(private=True)
        except Exception as exc:
            self._fatal_if_permanent(exc, "cannot create the exchange")
            self._say("warning", f"master repository initialization failed; continuing: {exc}")

    def _start_master(self) -> None:
        for name in self.config.collaborators:
            try:
                self.hub.add_collaborator(name, permission="write")
            except Exception as exc:
                self._say("warning", f"could not grant write access to {name}: {exc}")
        try:
            self.master.reconcile()
        except ExchangeError:
            raise  # an unusable exchange (e.g. a corrupt global and no local state): exit 2
        except Exception as exc:
            self._fatal_if_permanent(exc, "cannot use the exchange")
            self._say("warning", f"master could not reconcile with the repository yet: {exc}")
        self._ready = True

    def _fatal_if_permanent(self, exc: BaseException, what: str) -> None:
        """A permanent exchange error (auth refused, unusable path, invalid repo id) ends the
        node with exit code 2; an outage does not."""
        if isinstance(exc, AccessRefused):
            raise self._access_error(exc) from None
        if isinstance(exc, TransportError) and exc.kind == "permanent":
            raise ExchangeError(
                scrub(f"distributed.repo_id: {what} {self.config.repo_id!r}: {exc}", (self._token,))
            ) from None

    def _access_error(self, exc: AccessRefused) -> ExchangeAccessError:
        """Exit 2: the exchange refused this node's token; names the repository (the
        entrypoint adds where the token came from), never the token."""
        message = (
            f"distributed.repo_id: {self.config.repo_id!r} refused this node (HTTP "
            f"{exc.status or '?'}): {exc}; check that distributed.token exists and may write "
            "this repository"
        )
        return ExchangeAccessError(
            scrub(message, (self._token,)), repo_id=str(self.config.repo_id), status=exc.status
        )

    def _first_global(self) -> None:
        """Worker: the global to start from, before the first step.

        A global marked final ends a run. A node resumed into that run has nothing left to do
        (:attr:`run_ended`, at once). Any other node never trains from it: it waits (at most
        ``round_timeout``) for the first global of a new run, and when none comes, its run
        has ended too. With no global at all, a fresh node waits as long for the master's
        first one, then trains from its own weights; a resumed node goes on from its
        checkpointed round.
        """
        assert self.node is not None
        try:
            candidate = self._fetch((-1, ""))
        except Exception as exc:
            self._fatal_if_permanent(exc, "cannot read from the exchange")
            self._say("warning", f"initial global read failed; will retry: {exc}")
            candidate = None
        timeout = self.config.round_timeout
        if candidate is not None and candidate.final:
            old = f"outer step {candidate.outer_step}, run {candidate.run_id or '?'}"
            if self.node.run_id and candidate.run_id == self.node.run_id:
                self._end_run(
                    f"this node's run already ended: the exchange holds its final global "
                    f"({old}); nothing left to contribute"
                )
                return
            self._say(
                "info",
                f"the exchange holds the final global of a finished run ({old}); not training "
                f"from it: waiting up to {timeout:.0f} s (distributed.round_timeout) for the "
                "first global of a new run",
            )
            candidate, waited = self._wait_for_global((candidate.outer_step, candidate.run_id))
            if candidate is None:
                if not self._interrupted.is_set():
                    self._end_run(
                        f"the run on the exchange already ended (final global: {old}) and no "
                        f"new run started within {waited:.1f} s of waiting; nothing to join"
                    )
                return
        elif candidate is None:
            if self.node.installed >= 0:
                return  # resumed: continue from the checkpointed round
            self._say(
                "info",
                f"waiting up to {timeout:.0f} s (distributed.round_timeout) for the master's "
                "first global state",
            )
            candidate, waited = self._wait_for_global((-1, ""))
            if candidate is None:
                if not self._interrupted.is_set():
                    self._say(
                        "warning",
                        f"no global state was published within {waited:.1f} s of waiting; "
                        "training from local weights (the first global is merged when it "
                        "arrives)",
                    )
                return
        self.inbox.offer(candidate)

    def _wait_for_global(self, seen: tuple[int, str]) -> tuple[GlobalCandidate | None, float]:
        """Poll (at most ``round_timeout``, interruptible) for a published global other than
        ``seen`` that is not final; returns it (None: none came) and the seconds waited."""
        started = time.monotonic()
        deadline = started + self.config.round_timeout
        while not self._interrupted.is_set() and time.monotonic() < deadline:
            self._beat = time.monotonic()
            time.sleep(min(self.config.poll_interval, 1.0, max(deadline - time.monotonic(), 0)))
            try:
                candidate = self._fetch(seen)
            except Exception as exc:
                self._fatal_if_permanent(exc, "cannot read from the exchange")
                candidate = None
            if candidate is not None and candidate.final:
                seen, candidate = (candidate.outer_step, candidate.run_id), None
            if candidate is not None:
                return candidate, time.monotonic() - started
        return None, time.monotonic() - started

    def _end_run(self, why: str) -> None:
        """This node has no run to take part in: one line, and the trainer stops (exit 0)."""
        self._run_ended = why
        self._say("warning", why)
        self._emit("diloco_run_ended", {"node_id": self.node_id, "reason": why})

    def finish(self) -> None:
        """The run reached its target: the node's last contribution and ``done`` status;
        the master then serves rounds until every node is done or dropped and installs the
        final global (a bounded wait, see :meth:`_serve_until_final`)."""
        if self.node is not None:
            self.node.finish()
            self._ready = self._ready or self.node.installed >= 0
        if self.master is not None:
            self._serve_until_final()
            if self.node is not None:
                self.node.merge_waiting()
            elif self.master.finished.is_set():
                self.model.load_state_dict(T.cpu_state_dict(self.master.global_state), strict=False)

    def _serve_until_final(self) -> None:
        """Wait while the master's rounds go on until it published the final global.

        The wait is bounded by progress: when no new global came for ``(drop_after + 2)``
        times the longer of ``round_timeout`` and the longest round seen, plus
        ``STALL_MARGIN_S`` (a
        silent node is dropped after ``drop_after`` round lengths, so the master had every
        chance to close), it is a :class:`RoundsStalledError`. A fatal error of the master's
        thread is raised here too."""
        cfg = self.config
        started = time.monotonic()
        while not self.master.finished.is_set() and not self._interrupted.is_set():
            self._raise_master_fatal()
            now = self._beat = time.monotonic()
            rounds = (cfg.drop_after + 2) * max(cfg.round_timeout, self._longest_round)
            bound = rounds + STALL_MARGIN_S
            if now - self._global_at > bound:
                raise RoundsStalledError(
                    f"the master waited {now - started:.0f} s for its final global and no round "
                    f"closed in the last {now - self._global_at:.0f} s (bound {bound:.0f} s: "
                    "distributed.drop_after + 2 rounds of distributed.round_timeout or the "
                    f"longest round, plus {STALL_MARGIN_S:.0f} s); its state is saved, a "
                    "restart with --resume serves the open rounds again"
                )
            self.master.finished.wait(0.5)
        self._raise_master_fatal()

    def stop(self) -> None:
        """Let an upload in flight finish (bounded), stop the threads."""
        if self.node is not None and not self.node.stop():
            self._say("warning", "an upload was still in flight at stop; it is in the checkpoint")
        self.inbox.stop(self.config.delta_upload_shutdown_timeout)
        if self.master is not None:
            self._halt.set()  # a relay waiting for the top level stops waiting
            self.master.stop()
        self._started = False

    # -- transport calls ---------------------------------------------------------------------
    def _claim(self) -> None:
        """Write our claim/status record; another live node holding the id is a
        `NodeIdCollisionError`, raised before this node writes anything."""
        state = "training" if self.trains else "aggregator"
        status: dict[str, Any] = {"state": state}
        if self.node is not None and self.node.done:  # resumed after its last contribution
            state = "done"
            status = {"state": state, "final_round": self.node.last_round}
        try:
            owner = self.hub.read_owner(self.node_id)
            if self._collides(owner):
                raise NodeIdCollisionError(self.node_id)
            if self.claim.held_elsewhere(owner):
                self._watch_holder(owner)
            other = (owner or {}).get("instance")
            if other and other != self.claim.instance:
                self._displaced = str(other)
            if other != self.claim.instance or owner.get("state") != state:
                self.hub.claim_owner(self.node_id, self.claim.record(**status))
            self.claim.claimed = True
        except NodeIdCollisionError:
            raise
        except Exception as exc:
            self._fatal_if_permanent(exc, "cannot write to the exchange")
            self._say("warning", f"could not claim node_id {self.node_id}: {exc}")

    def _watch_holder(self, owner: Mapping[str, Any]) -> None:
        """Another host's node holds our id and had not finished: watch its files (up to
        ``round_timeout``; a live node writes at every round). A change is a
        `NodeIdCollisionError`; none means its instance is gone, and the id is taken over."""
        holder = f"instance {owner.get('instance')} on host {owner.get('host', '?')}"
        window = self.config.round_timeout
        prefix = f"nodes/{self.node_id}/"
        self._say(
            "info",
            f"node id {self.node_id!r} is held by {holder} (state {owner.get('state')}); "
            f"watching its files for up to {window:.0f} s (distributed.round_timeout) before "
            "taking the id over",
        )

        def files() -> dict[str, Any]:
            return {p: i for p, i in self.hub.scan().files.items() if p.startswith(prefix)}

        before, started = files(), time.monotonic()
        while time.monotonic() - started < window and not self._interrupted.is_set():
            self._beat = time.monotonic()
            time.sleep(min(self.config.poll_interval, 1.0))
            if files() != before:
                waited = time.monotonic() - started
                self._emit("node_id_collision", {"node_id": self.node_id})
                raise NodeIdCollisionError(
                    self.node_id, f"{holder} wrote to the exchange {waited:.1f} s into the watch"
                )
        self._say(
            "info",
            f"{holder} wrote nothing in {time.monotonic() - started:.1f} s; taking node id "
            f"{self.node_id!r} over (that instance is gone)",
        )

    def _collides(self, owner: Mapping[str, Any] | None) -> bool:
        other = self.claim.check(owner)
        if other is None:
            return False
        self._say(
            "error",
            f"node_id collision: another live node uses node_id {self.node_id!r} (instance "
            f"{other}); give each node a unique distributed.node_id",
        )
        self._emit("node_id_collision", {"node_id": self.node_id})
        return True

    def _send(self, job: Contribution) -> int:
        """Upload one contribution with our status record (one commit); returns bytes."""
        with contextlib.suppress(TransportError):  # the upload below reports an outage
            owner = self.hub.read_owner(self.node_id)
            if self._displaced and (owner or {}).get("instance") == self._displaced:
                # the instance this node took the id over from writes again: it is live, and
                # this node is the later of the two (it stops; nothing of the other is lost)
                self._emit("node_id_collision", {"node_id": self.node_id})
                raise NodeIdCollisionError(
                    self.node_id,
                    f"instance {self._displaced} wrote again after this node took the id over",
                )
            self._collides(owner)
        status = {"state": "done", "final_round": job.round} if job.final else {"state": "training"}
        try:
            if job.delta is None:  # nothing left to contribute: only the done status
                record = self.claim.record(state="done", final_round=job.round)
                self.hub.claim_owner(self.node_id, record)
                nbytes = 0
            else:
                self.hub.upload_delta(
                    job.delta,
                    node_id=self.node_id,
                    round_index=job.round,
                    local_step=job.step,
                    base_outer_step=job.base,
                    dtype=self.config.delta_dtype,
                    metadata={
                        "final": str(job.final).lower(),
                        "run_id": job.run_id,
                        "instance": self.claim.instance,
                    },
                    owner=self.claim.record(**status),
                )
                nbytes = int(self.hub.last_upload_bytes)
        except AccessRefused as exc:  # the node stops at its next step (exit 2)
            raise self._access_error(exc) from None
        self.claim.claimed = True
        if self.master is not None:
            self.master.wake.set()
        return nbytes

    def _fetch(self, seen: tuple[int, str]) -> GlobalCandidate | None:
        """The published global when it is new; a refused one (too large, non-finite) is
        reported once and not downloaded again."""
        started = time.perf_counter()
        metadata = self.hub.global_metadata()
        if metadata is None or (metadata.outer_step, metadata.run_id) == seen:
            return None
        if metadata.sha256 and metadata.sha256 == self._refused:
            return None
        values = sum(v.numel() for v in self.model.state_dict().values())
        try:
            metadata, state = self.hub.fetch_global(metadata, max_bytes=4 * values + (1 << 20))
        except TransportError as exc:
            if exc.kind != "permanent":
                raise
            self._refused = metadata.sha256
            self._say("error", f"refusing the published global: {exc}")
            self._emit("global_rejected", {"outer_step": metadata.outer_step, "error": str(exc)})
            return None
        return GlobalCandidate(
            metadata.outer_step,
            state,
            time.perf_counter() - started,
            metadata.final,
            metadata.run_id,
        )

    def _offer(self, outer_step: int, state: dict[str, torch.Tensor]) -> None:
        now = time.monotonic()
        self._longest_round = max(self._longest_round, now - self._global_at)
        self._global_at = now
        run_id = self.master.run_id if self.master is not None else ""
        self.inbox.offer(GlobalCandidate(outer_step, state, run_id=run_id))

    def _write_final(self, outer_step: int, state: dict[str, torch.Tensor]) -> None:
        """``final/``: the final global, the redacted config and what produced it."""
        if self.final_dir is None:
            return
        import yaml

        directory = self.final_dir
        T.save_safetensors(state, directory / "model.safetensors")
        atomic_write_bytes(
            yaml.safe_dump(self.run_config, sort_keys=False).encode("utf-8"),
            directory / "config.yaml",
        )
        meta = {
            "outer_step": outer_step,
            "step": outer_step * self.config.inner_steps,  # node steps behind this global
            "node_id": self.node_id,
            "ledger": dict(sorted(self.master.ledger.items())) if self.master else {},
            "written_at": datetime.now(timezone.utc).isoformat(),
        }
        atomic_write_bytes(
            (json.dumps(meta, indent=2) + "\n").encode("utf-8"), directory / "meta.json"
        )
        self._emit("diloco_final", {"outer_step": outer_step, "path": str(directory)})

    # -- checkpointed state ---------------------------------------------------------------
    _prepared_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """The node's round state (the master keeps its own in ``state_dir``)."""
        return {
            "node_id": self.node_id,
            "role": self.role,
            "node": self.node.state_dict() if self.node is not None else None,
            "outer": self.master.state_dict() if self.master is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore checkpointed state (applied at ``start()`` when not started yet)."""
        self._prepared = dict(state)
        if self._started:
            pending = self._apply_prepared()
            if pending is not None and self.node is not None:
                self.node.uploads.submit(pending)

    def _apply_prepared(self) -> Contribution | None:
        state, self._prepared = self._prepared, None
        if not state or self.node is None or not state.get("node"):
            return None
        pending = self.node.load_state_dict(state["node"])
        self._prepared_step = self.node.step
        return pending


DumbDiLoCo = DumbDiLoCoCoordinator
