"""The wiring: builds a node's round, the master's round and the store from the config.

The trainer sees one object (its ``SyncCoordinator``): it attaches it to the inner optimizer
and calls ``start`` / ``finish`` (the run reached its target) / ``stop``. What happens in a
round lives in two modules: :mod:`.node` (the node side, hooked on ``optimizer.step``, with
its link to the exchange) and :mod:`.master` (the master's round, on its own thread). This
module builds them and the store (:func:`build_transport`) from the ``distributed`` config
section and owns the order of startup, the end of the run, the final directory
(:func:`write_final`) and the checkpointed state.

Reporting: every DiLoCo class logs to the ``speedtronic.diloco`` logger and reports events
through one ``emit(event, **fields)``, which the coordinator builds from its ``logger`` (the
metrics logger). The token never appears in either: string fields are scrubbed, and while the
coordinator runs a filter on the logger scrubs every line.

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
from speedtronic.diloco import wire
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import (
    ExchangeError,
    RetryPolicy,
    max_global_bytes,
    retry_policy_from_config,
    scrub,
)
from speedtronic.diloco.hub import HubClient
from speedtronic.diloco.master import RoundMaster
from speedtronic.diloco.node import (
    Contribution,
    DiLoCoNode,
    GlobalCandidate,
    GlobalInbox,
    NodeClaim,
    NodeLink,
    resolve_node_id,
)
from speedtronic.diloco.relay import Upstream

__all__ = [
    "DumbDiLoCo",
    "DumbDiLoCoCoordinator",
    "RoundsStalledError",
    "build_transport",
    "resolve_node_id",
    "write_final",
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


class _ScrubToken(logging.Filter):
    """Replaces the token, in every form it can take (:func:`scrub`), in each line of the
    logger it is added to."""

    def __init__(self, token: str | None):
        super().__init__()
        self.secrets = (token,)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


class RoundsStalledError(RuntimeError):
    """The master's rounds made no progress for longer than any round may take (exit 1: a
    restart resumes them)."""


class DumbDiLoCoCoordinator:
    """One node's DiLoCo participation (see the module docstring).

    ``config`` is the ``distributed`` section (or a whole config); ``hub`` the exchange's
    store (built from ``repo_id`` when None); ``logger`` receives the events (its
    ``emit(event, payload)``; without one, they are lines of the ``speedtronic.diloco``
    logger); ``state_dir`` the base of this node's local state (the node id
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
        self._scrubber = _ScrubToken(cfg.token)
        self.node_id = resolve_node_id(cfg.node_id, environ or os.environ)
        self.role = cfg.node_role
        self.trains = cfg.train or self.role != "master"
        if hub is None:
            retry = retry_policy_from_config(cfg)
            retry.on_retry = self._on_retry
            hub = build_transport(cfg, retry)
        elif getattr(hub, "retry", None) is not None and hub.retry.on_retry is None:
            hub.retry.on_retry = self._on_retry
        self.store = hub
        self.state_dir = Path(state_dir or cfg.state_dir) / self.node_id
        self.state_dir.mkdir(parents=True, exist_ok=True)
        host = (environ or os.environ).get("HOSTNAME") or None  # a container's or pod's name
        self.claim = NodeClaim(self.node_id, self.role, self.state_dir, host=host)
        self._interrupted = threading.Event()
        like = model.state_dict()  # the global must fit this model's shapes and dtypes
        self.link = NodeLink(
            hub,
            cfg,
            claim=self.claim,
            max_bytes=max_global_bytes(like),  # the master's own bound for the same file
            like=like,
            interrupted=self._interrupted,
            emit=self._emit,
        )
        self.final_dir = Path(final_dir) if final_dir is not None else None
        self.run_config = dict(run_config or {})
        self.inbox = GlobalInbox(
            None if self.role == "master" else self.link.fetch,
            interval=cfg.poll_interval,
            threaded=cfg.async_global_poll,
        )
        self.node = (
            DiLoCoNode(
                cfg,
                model,
                send=self._send,
                inbox=self.inbox,
                emit=self._emit,
            )
            if self.trains
            else None
        )
        self.master: RoundMaster | None = None
        if self.role == "master":
            self._halt = threading.Event()
            self.master = RoundMaster(
                hub,
                wire.cpu_state_dict(model.state_dict()),
                settings=cfg,
                state_dir=self.state_dir,
                emit=self._emit,
                on_global=self._offer,
                evaluate=None if cfg.relay_to else evaluate,
                on_final=self._write_final,
                upstream=self._upstream(cfg) if cfg.relay_to else None,
            )
        self._prepared: Mapping[str, Any] | None = None
        self._resumed = False  # a checkpoint with this coordinator's state was applied
        self._run_ended: str | None = None  # why this node has no run to take part in
        self._master_hook: Any = None  # raises the master thread's fatal error on each step
        self._global_at = time.monotonic()  # when the last global was handed to this process
        self._longest_round = 0.0  # the longest time between two globals seen here
        self._started = False
        self._ready = False
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
            stop=self._halt,
        )

    # -- reporting ---------------------------------------------------------------------------
    def _emit(self, event: str, /, **fields: Any) -> None:
        """The one ``emit`` every DiLoCo object reports through: string fields scrubbed of
        the token, handed to the metrics logger's ``emit(event, payload)``."""
        clean = {
            k: scrub(v, (self._token,)) if isinstance(v, str) else v for k, v in fields.items()
        }
        emit = getattr(self.logger, "emit", None)
        if callable(emit):
            emit(event, clean)
        else:
            self.logger.info("%s %s", event, clean)

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
        return self.node.installed if self.node is not None else -1

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
            self.link.raise_if_permanent(self.master.fatal, "the master cannot use the exchange")
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
        if self._scrubber not in _LOG.filters:
            _LOG.addFilter(self._scrubber)  # removed at stop()
        pending = self._apply_prepared()
        if self.node is not None and step is not None and self._prepared_step is None:
            self.node.step = int(step)
        if self.master is not None:  # a master starting from scratch starts a new run
            self.master.fresh = self._starts_new_run(step)
        with self._quick_retries():  # an outage must not hold training at startup
            if self.master is not None:
                self._create_exchange()
                self.link.claim_id(**self._status())
                self._start_master()
            else:  # a worker claims its id only once it found a run to take part in
                resumed = self.node.installed >= 0
                self.link.check_id()  # a live process here with our id: exit 2 before waiting
                candidate, ended = self.link.first_global(self.node.run_id, resumed)
                if ended:
                    self._end_run(ended)
                    self._started = True
                    return
                if candidate is not None:
                    self.inbox.offer(candidate)
                self.link.claim_id(**self._status())
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
        _LOG.info(
            f"DumbDiLoCo started role={self.role} node_id={self.node_id} "
            f"global_step={self.last_global_step} sync={self.config.sync}"
        )
        self._emit(
            "diloco_started",
            role=self.role,
            node_id=self.node_id,
            global_step=self.last_global_step,
        )

    def _starts_new_run(self, step: int | None) -> bool:
        """Whether this master starts a new run (over a finished one on the exchange): only
        from scratch. A trained step or a checkpoint with coordinator state (an ``outer``
        section, node state) is a resumed run; a pure aggregator's step is always 0, so its
        own local outer state (``state_dir``: it served a run) says it is restarted too."""
        if step or self._resumed:
            return False
        return self.trains or not self.master.has_local_state

    def _status(self) -> dict[str, Any]:
        """The status record this node claims its id with at startup."""
        if self.node is not None and self.node.done:  # resumed after its last contribution
            return {"state": "done", "final_round": self.node.last_round}
        return {"state": "training" if self.trains else "aggregator"}

    @contextlib.contextmanager
    def _quick_retries(self) -> Iterator[None]:
        """At most two attempts per call during startup; the threads retry fully later."""
        retry = getattr(self.store, "retry", None)
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
            self.store.create_repo(private=True)
        except Exception as exc:
            self.link.raise_if_permanent(exc, "cannot create the exchange")
            self.master.exchange_created = False  # the master's thread creates it later
            _LOG.warning(
                f"master repository initialization failed; continuing (retried at every "
                f"poll): {exc}"
            )

    def _start_master(self) -> None:
        for name in self.config.collaborators:
            try:
                self.store.add_collaborator(name, permission="write")
            except Exception as exc:
                _LOG.warning(f"could not grant write access to {name}: {exc}")
        try:
            self.master.reconcile()
        except ExchangeError:
            raise  # an unusable exchange (e.g. a corrupt global and no local state): exit 2
        except Exception as exc:
            self.link.raise_if_permanent(exc, "cannot use the exchange")
            _LOG.warning(f"master could not reconcile with the repository yet: {exc}")
        self._ready = True

    def _end_run(self, why: str) -> None:
        """This node has no run to take part in: one line, and the trainer stops (exit 0)."""
        self._run_ended = why
        _LOG.warning(why)
        self._emit("diloco_run_ended", node_id=self.node_id, reason=why)

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
                self.model.load_state_dict(
                    wire.cpu_state_dict(self.master.global_state), strict=False
                )

    def _serve_until_final(self) -> None:
        """Wait while the master's rounds go on until it published the final global.

        The wait is bounded by progress, not by the last global: a round may be slow, or the
        workers may start long after a pure aggregator entered here. Progress is the later of
        the last global handed to this process and the master's ``last_progress`` (a
        contribution seen, a node's status record changed, a round closed, the master's
        start). When there was none for ``(drop_after + 2)`` times the longer of
        ``round_timeout`` and the longest round seen, plus ``STALL_MARGIN_S`` (a silent node
        is dropped after ``drop_after`` round lengths, so the master had every chance to
        close), it is a :class:`RoundsStalledError`. A fatal error of the master's thread is
        raised here too."""
        cfg = self.config
        started = time.monotonic()
        while not self.master.finished.is_set() and not self._interrupted.is_set():
            self._raise_master_fatal()
            now = self._beat = time.monotonic()
            progress = max(self._global_at, self.master.last_progress)
            rounds = (cfg.drop_after + 2) * max(cfg.round_timeout, self._longest_round)
            bound = rounds + STALL_MARGIN_S
            if now - progress > bound:
                raise RoundsStalledError(
                    f"the master waited {now - started:.0f} s for its final global and saw no "
                    f"progress (no contribution, node status change or closed round) in the "
                    f"last {now - progress:.0f} s (bound {bound:.0f} s: distributed.drop_after "
                    "+ 2 rounds of distributed.round_timeout or the longest round, plus "
                    f"{STALL_MARGIN_S:.0f} s); its state is saved, a restart with --resume "
                    "serves the open rounds again"
                )
            self.master.finished.wait(0.5)
        self._raise_master_fatal()

    def stop(self) -> None:
        """Let an upload in flight finish (bounded), stop the threads."""
        if self.node is not None and not self.node.stop():
            _LOG.warning("an upload was still in flight at stop; it is in the checkpoint")
        self.inbox.stop(self.config.delta_upload_shutdown_timeout)
        if self.master is not None:
            self._halt.set()  # a relay waiting for the top level stops waiting
            self.master.stop()
        self._started = False
        _LOG.removeFilter(self._scrubber)

    def _send(self, job: Contribution) -> int:
        """The node's upload (see :meth:`NodeLink.send`); a local master looks at once."""
        nbytes = self.link.send(job)
        if self.master is not None:
            self.master.wake.set()
        return nbytes

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
        meta = {
            "outer_step": outer_step,
            "step": outer_step * self.config.inner_steps,  # node steps behind this global
            "node_id": self.node_id,
            "ledger": dict(sorted(self.master.ledger.items())) if self.master else {},
        }
        write_final(self.final_dir, state, meta=meta, run_config=self.run_config)
        self._emit("diloco_final", outer_step=outer_step, path=str(self.final_dir))

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
        if state and (state.get("outer") or state.get("node")):
            self._resumed = True  # the run this state belongs to goes on
        if not state or self.node is None or not state.get("node"):
            return None
        pending = self.node.load_state_dict(state["node"])
        self._prepared_step = self.node.step
        return pending


DumbDiLoCo = DumbDiLoCoCoordinator


def build_transport(
    config: Any, retry: RetryPolicy | None = None
) -> DirectoryTransport | HubClient:
    """``file:///abs`` -> :class:`DirectoryTransport`; ``owner/name`` -> :class:`HubClient`.

    ``config`` is the ``distributed`` section (``repo_id``, ``token``, ``cache_dir``,
    ``round_timeout`` and the retry settings); ``retry`` overrides the policy built from it.
    A Hub repository that answers "not found" is taken for one its master has not created
    yet for ``round_timeout`` seconds (what a worker waits for the first global), then for
    one the token cannot see (a permanent ``AccessRefused``).
    """
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
    meta: Mapping[str, Any],
    run_config: Mapping[str, Any],
) -> None:
    """The final global as ``model.safetensors``, ``run_config`` (redacted) as
    ``config.yaml`` and ``meta`` (outer step, steps behind it, node, ledger) with the time it
    was written as ``meta.json``, each file written atomically."""
    import yaml

    wire.save_safetensors(dict(state), directory / "model.safetensors")
    atomic_write_bytes(
        yaml.safe_dump(dict(run_config), sort_keys=False).encode("utf-8"),
        directory / "config.yaml",
    )
    record = {**meta, "written_at": datetime.now(timezone.utc).isoformat()}
    atomic_write_bytes(
        (json.dumps(record, indent=2) + "\n").encode("utf-8"), directory / "meta.json"
    )
