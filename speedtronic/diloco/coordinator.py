"""DumbDiLoCo coordinator: the trainer's ``SyncCoordinator`` for master and worker nodes.

A round is an explicit state machine (``RoundPhase``)::

    SNAPSHOT  baseline := the installed global (or the local init)
    INNER     inner optimizer steps until ``step % inner_steps == 0``
    PUSH      delta = carry + (baseline - current) queued (one slot) or uploaded (sync mode)
    COMMIT    a newer global (aggregated by the master) is installed -> SNAPSHOT

The training thread only computes deltas and installs globals; network I/O runs on two
daemon threads (``speedtronic-diloco-upload``, ``speedtronic-diloco-poll``) unless both async
flags are false. A new global is installed at a round boundary (right after the delta of
that boundary was taken, so local progress is never overwritten) or at the first step when
no global was known yet. A failed upload is carried: its delta is added to the next one, so
every contribution reaches the master once. A transport failure is state, never a crash.

The master also runs :class:`~speedtronic.diloco.outer.MasterOuterLoop` on its own thread.
This module keeps the round (lifecycle, per-step hook, install, identity, checkpoint state);
the lanes do the I/O: :mod:`.delta_lane` (baseline, delta, carry, upload queue and thread),
:mod:`.global_lane` (worker polls) and :mod:`.master_lane` (repository, outer loop, snapshot).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.delta_lane import DeltaLane
from speedtronic.diloco.global_lane import GlobalLane
from speedtronic.diloco.identity import NodeClaim, resolve_node_id
from speedtronic.diloco.master_lane import MasterLane
from speedtronic.diloco.outer import MasterOuterLoop
from speedtronic.diloco.rounds import DeltaUploadJob, GlobalCandidate, RoundPhase
from speedtronic.diloco.transport import (
    TransportError,
    build_transport,
    retry_policy_from_config,
    scrub,
)

__all__ = [
    "DeltaUploadJob",
    "DumbDiLoCoCoordinator",
    "GlobalCandidate",
    "RoundPhase",
    "build_transport",
    "resolve_node_id",
]

_LOG = logging.getLogger("speedtronic.diloco")


def _distributed_section(config: Any) -> Any:
    if isinstance(config, Mapping):
        from speedtronic.config import SpeedtronicConfig

        return SpeedtronicConfig.from_dict(dict(config)).distributed
    return getattr(config, "distributed", config)


class DumbDiLoCoCoordinator:
    """Attach to a trainer as its sync coordinator; ``start``/``stop`` bracket ``fit()``."""

    def __init__(
        self,
        config: Any,
        model: torch.nn.Module,
        *,
        hub: Any = None,
        state_dir: str | os.PathLike | None = None,
        logger: Any = None,
        environ: Mapping[str, str] | None = None,
    ):
        self.config = cfg = _distributed_section(config)
        self.model = model
        self.logger = logger if logger is not None else _LOG
        self._token = getattr(cfg, "token", None)
        self.node_id = resolve_node_id(getattr(cfg, "node_id", None), environ or os.environ)
        role = str(getattr(cfg, "role", "single")).lower()
        if role == "single":
            role = "master" if getattr(cfg, "repo_id", None) else "worker"
        self.role = role
        self.inner_steps = int(getattr(cfg, "inner_steps", 500))
        self.poll_interval = float(getattr(cfg, "poll_interval", 60.0))
        self.delta_dtype = str(getattr(cfg, "delta_dtype", "fp32") or "fp32").lower()
        T.delta_dtype(self.delta_dtype)
        self.async_upload = bool(getattr(cfg, "async_delta_upload", True))
        self.async_poll = bool(getattr(cfg, "async_global_poll", True))
        self.shutdown_timeout = float(getattr(cfg, "delta_upload_shutdown_timeout", 5.0))
        if hub is None:
            retry = retry_policy_from_config(cfg)
            retry.on_retry = self._on_retry
            hub = build_transport(cfg, retry)
        elif getattr(hub, "retry", None) is not None and hub.retry.on_retry is None:
            hub.retry.on_retry = self._on_retry
        self.hub = hub
        self.state_dir = (
            Path(state_dir or getattr(cfg, "state_dir", ".speedtronic/diloco")) / self.node_id
        )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.claim = NodeClaim(self.node_id, self.role, self.state_dir)
        self._lock = threading.RLock()
        self._started = self._stopped = self._ready = False
        self._accepting_uploads = True
        self._last_global_step = -1
        self._local_step = 0
        self.phase = RoundPhase.SNAPSHOT
        self._prepared_state: dict[str, Any] | None = None
        self.delta_lane = DeltaLane(
            T.cpu_state_dict(model.state_dict()),
            lock=self._lock,
            send=self._send_delta,
            emit=self._emit,
            say=self._say,
            token=self._token,
        )
        self.global_lane = GlobalLane(
            self.hub,
            lock=self._lock,
            interval=self.poll_interval,
            installed_step=lambda: self._last_global_step,
            say=self._say,
        )
        self.master_lane = MasterLane(
            self.hub,
            cfg,
            state_dir=self.state_dir,
            poll_interval=self.poll_interval,
            emit=self._emit,
            say=self._say,
            log=self.logger,
        )

    # -- small helpers ---------------------------------------------------------------
    def _emit(self, event: str, payload: dict[str, Any]) -> None:
        emit = getattr(self.logger, "emit", None)
        if callable(emit):
            emit(event, payload)
        else:
            self.logger.info("%s %s", event, payload)

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

    def _check_owner(self, claim: bool) -> None:
        """Report another live process using our node id; (re)claim it at startup."""
        owner = self.hub.read_owner(self.node_id)
        other = self.claim.check(owner)
        if other is not None:
            self._say(
                "error",
                f"node_id collision: another live node uses node_id {self.node_id!r} "
                f"(instance {other}); give each node a unique distributed.node_id",
            )
            self._emit("node_id_collision", {"node_id": self.node_id})
        if claim and other is None:
            # Never take the id over from a live node: the newcomer is the one in the wrong.
            if (owner or {}).get("instance") != self.claim.instance:
                self.hub.claim_owner(self.node_id, self.claim.record())
            self.claim.claimed = True

    # -- public read-only state ---------------------------------------------------------------
    @property
    def local_step(self) -> int:
        return self._local_step

    @property
    def last_global_step(self) -> int:
        return self._last_global_step

    @property
    def outer_step(self) -> int:
        if self.outer_loop is not None:
            return self.outer_loop.outer_step
        return max(self._last_global_step, 0)

    def is_ready(self) -> bool:
        """Master: after startup. Worker: once the first global state is installed."""
        return self._ready

    @property
    def outer_loop(self) -> MasterOuterLoop | None:
        """The master's outer loop once started (None on a worker)."""
        return self.master_lane.loop

    @property
    def _baseline(self) -> dict[str, torch.Tensor]:
        return self.delta_lane.baseline

    @property
    def _upload_thread(self) -> threading.Thread | None:
        return self.delta_lane.thread

    @property
    def _poll_thread(self) -> threading.Thread | None:
        return self.global_lane.thread

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Role startup (repository, reconcile, first global), then the I/O threads."""
        with self._lock:
            if self._started:
                return
            self._stopped = False
            self._accepting_uploads = True
            with self._quick_retries():  # an outage must not hold training at startup
                if self.role == "master":
                    self._start_master()
                else:
                    self._start_worker()
            self._start_io_workers()
            self._started = True
            self.global_lane.last_poll = time.monotonic()
        self._say(
            "info",
            f"DumbDiLoCo started role={self.role} node_id={self.node_id} "
            f"global_step={self._last_global_step}",
        )
        self._emit(
            "diloco_started",
            {"role": self.role, "node_id": self.node_id, "global_step": self._last_global_step},
        )

    @contextlib.contextmanager
    def _quick_retries(self) -> Iterator[None]:
        """At most two attempts per call during startup (no I/O thread runs yet); the
        background lanes and the outer loop retry with the full policy afterwards."""
        retry = getattr(self.hub, "retry", None)
        if retry is None or not hasattr(retry, "attempts"):
            yield
            return
        saved = retry.attempts
        retry.attempts = min(saved, 2)
        try:
            yield
        finally:
            retry.attempts = saved

    def _start_master(self) -> None:
        self.master_lane.open(T.cpu_state_dict(self.model.state_dict()))
        self._apply_prepared_state()
        self.master_lane.reconcile()
        self._install_master_snapshot(force=True)
        self._claim_safely()
        self.outer_loop.start()
        self._ready = True

    def _start_worker(self) -> None:
        self._apply_prepared_state()
        self._claim_safely()
        if self.global_lane.read_first(self._install_state):
            self._ready = True

    def _claim_safely(self) -> None:
        try:
            self._check_owner(claim=True)
        except Exception as exc:
            self._say("warning", f"could not claim node_id {self.node_id}: {exc}")

    def _start_io_workers(self) -> None:
        if self.async_upload:
            self.delta_lane.start()
        if self.async_poll and self.role == "worker":
            self.global_lane.start()

    def stop(self) -> None:
        """Stop accepting uploads, drain/join the I/O threads (bounded), stop the outer loop."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._accepting_uploads = False
            self.delta_lane.stop_event.set()
            self.global_lane.stop_event.set()
            uploader, poller = self.delta_lane.thread, self.global_lane.thread
            outer = self.outer_loop
        for thread, name in ((uploader, "async delta uploader"), (poller, "async global poller")):
            if (
                thread is not None
                and thread.is_alive()
                and thread is not threading.current_thread()
            ):
                thread.join(self.shutdown_timeout)
                if thread.is_alive():
                    self._say("warning", f"{name} did not stop within the timeout")
        with self._lock:
            self.global_lane.thread = None
            self._started = False
        if outer is not None:
            outer.stop()

    # -- the per-step hook ---------------------------------------------------------------
    def after_optimizer_step(self, model: torch.nn.Module, step: int) -> bool:
        """Called after every applied update; True means "reset the inner optimizer"."""
        if model is not self.model:
            raise ValueError("coordinator is attached to a different model")
        self._local_step = int(step)
        boundary = self._local_step % self.inner_steps == 0
        if self.phase == RoundPhase.SNAPSHOT:
            self.phase = RoundPhase.INNER
        pushed = self._push(self._local_step) if boundary else False
        loaded = self._commit_global(boundary)
        return bool(pushed or loaded)

    # PUSH ---------------------------------------------------------------
    def _push(self, step: int) -> bool:
        """Take this boundary's delta; upload it (sync mode) or queue it (one slot)."""
        if not self._accepting_uploads:
            return False
        if self.async_upload and self.delta_lane.skip_if_in_flight(step):
            return False
        current = T.cpu_state_dict(self.model.state_dict())
        with self._lock:
            base = self._last_global_step
        job = self.delta_lane.take_delta(step, current, base)
        if job is None:
            return False
        if not self.async_upload:
            self.delta_lane.clear_carry()
            self.phase = RoundPhase.PUSH
            return self.delta_lane.upload(job)
        with self._lock:
            if not self.delta_lane.enqueue(job):
                return False
            self.phase = RoundPhase.PUSH
        self._emit("delta_upload_queued", {"step": step, "base_outer_step": job.base_outer_step})
        return True

    def _send_delta(self, job: DeltaUploadJob) -> int:
        """The transport call of an upload, carrying our claim; returns the bytes sent."""
        with contextlib.suppress(TransportError):  # the upload below reports an outage
            self._check_owner(claim=False)
        _, nbytes = self.hub.upload_delta(
            job.delta,
            node_id=self.node_id,
            local_step=job.step,
            base_outer_step=job.base_outer_step,
            dtype=self.delta_dtype,
            metadata={"algorithm": "dumb_diloco"},
            owner=self.claim.record(),
        )
        self.claim.claimed = True  # the upload commit carried our claim
        return nbytes

    # COMMIT ---------------------------------------------------------------
    def _commit_global(self, boundary: bool) -> bool:
        """Install a newer global at a boundary (or when none is known yet)."""
        may_install = boundary or self._last_global_step < 0
        if self.role == "master":
            return self._install_master_snapshot(force=may_install)
        if self.async_poll:
            loaded = False
            if may_install:
                candidate = self.global_lane.take_candidate()
                if candidate is not None and candidate.outer_step > self._last_global_step:
                    self._install_state(candidate.state, candidate.outer_step, candidate.seconds)
                    loaded = True
            self.global_lane.schedule(force=boundary)
            return loaded
        if not may_install:
            return False
        candidate = self.global_lane.fetch_due(force=boundary)
        if candidate is None:
            return False
        self._install_state(candidate.state, candidate.outer_step, candidate.seconds)
        return True

    def _install_master_snapshot(self, force: bool) -> bool:
        snapshot = self.master_lane.newer_snapshot(than=self._last_global_step)
        if not force or snapshot is None:
            return False
        self._install_state(snapshot[1], snapshot[0], 0.0)
        return True

    def _install_state(
        self, state: Mapping[str, torch.Tensor], outer_step: int, seconds: float
    ) -> None:
        """Training thread only: load matching keys, reset the baseline, start a round."""
        current = self.model.state_dict()
        filtered = {
            k: v
            for k, v in state.items()
            if k in current and tuple(current[k].shape) == tuple(v.shape)
        }
        if filtered:
            self.model.load_state_dict(filtered, strict=False)
        with self._lock:
            self.delta_lane.rebase(T.cpu_state_dict(self.model.state_dict()))
            self._last_global_step = int(outer_step)
            self._ready = True
            self.phase = RoundPhase.SNAPSHOT
        self._emit("global_pulled", {"outer_step": int(outer_step), "seconds": float(seconds)})

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, baseline, carried delta, the pending job, and the master's outer state."""
        with self._lock:
            lane = self.delta_lane
            job = lane.pending
            return {
                "node_id": self.node_id,
                "role": self.role,
                "phase": self.phase.value,
                "last_global_step": self._last_global_step,
                "last_uploaded_step": lane.last_uploaded_step,
                "last_dispatched_step": lane.last_dispatched_step,
                "last_skipped_step": lane.last_skipped_step,
                "local_step": self._local_step,
                "baseline_generation": lane.generation,
                "baseline": T.cpu_state_dict(lane.baseline),
                "carry": T.cpu_state_dict(lane.carry) if lane.carry is not None else None,
                "pending_upload": None if job is None else job.to_dict(),
                "outer": self.master_lane.state_dict(),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpointed state; a pending job is queued again when running."""
        with self._lock:
            self._restore(state)
            self.master_lane.load_state_dict(state.get("outer"))
        if self._started and self.async_upload:
            self.delta_lane.requeue_pending()

    def prepare_state(self, state: Mapping[str, Any]) -> None:
        """Stage checkpointed state for the next ``start()`` (applied before any remote read)."""
        self._prepared_state = dict(state)

    def _apply_prepared_state(self) -> None:
        state, self._prepared_state = self._prepared_state, None
        if state is None:
            return
        with self._lock:
            self._restore(state)
            self.master_lane.load_state_dict(state.get("outer"))
            if self._last_global_step >= 0:
                self._ready = True

    def _restore(self, state: Mapping[str, Any]) -> None:
        self._last_global_step = int(state.get("last_global_step", self._last_global_step))
        self._local_step = int(state.get("local_step", self._local_step))
        self.delta_lane.restore(state)
        if state.get("phase") in {p.value for p in RoundPhase}:
            self.phase = RoundPhase(state["phase"])


DumbDiLoCo = DumbDiLoCoCoordinator
