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
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.identity import NodeClaim, resolve_node_id
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
        self._last_poll = 0.0
        self._last_global_step = -1
        self._last_uploaded_step: int | None = None
        self._last_dispatched_step: int | None = None
        self._last_skipped_step: int | None = None
        self._local_step = 0
        self._baseline = T.cpu_state_dict(model.state_dict())
        self._baseline_generation = 0
        self._carry: dict[str, torch.Tensor] | None = None
        self.phase = RoundPhase.SNAPSHOT
        self.outer_loop: MasterOuterLoop | None = None
        self._outer_snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        self._upload_queue: queue.Queue[DeltaUploadJob] = queue.Queue(maxsize=1)
        self._upload_stop = threading.Event()
        self._upload_thread: threading.Thread | None = None
        self._upload_busy = False
        self._pending_upload: DeltaUploadJob | None = None
        self._poll_queue: queue.Queue[bool] = queue.Queue(maxsize=1)
        self._poll_stop = threading.Event()
        self._poll_thread: threading.Thread | None = None
        self._poll_busy = False
        self._global_candidate: GlobalCandidate | None = None
        self._prepared_state: dict[str, Any] | None = None

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
        if claim and (owner or {}).get("instance") != self.claim.instance:
            self.hub.claim_owner(self.node_id, self.claim.record())
        if claim:
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
            self._last_poll = time.monotonic()
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
        try:
            self.hub.create_repo(private=True)
        except Exception as exc:
            self._say(
                "warning", f"master repository initialization failed; continuing locally: {exc}"
            )
        for name in getattr(self.config, "collaborators", None) or []:
            try:
                self.hub.add_collaborator(name, permission="write")
            except Exception as exc:
                self._say("warning", f"could not grant write access to {name}: {exc}")
        self.outer_loop = MasterOuterLoop(
            self.hub,
            T.cpu_state_dict(self.model.state_dict()),
            node_state_dir=self.state_dir,
            outer_lr=float(getattr(self.config, "outer_lr", 0.7)),
            outer_momentum=float(getattr(self.config, "outer_momentum", 0.9)),
            poll_interval=self.poll_interval,
            on_global_update=self._on_outer_update,
            emit=self._emit,
            log=self.logger,
        )
        self._apply_prepared_state()
        try:
            self.outer_loop.reconcile()
        except Exception as exc:
            self._say("warning", f"master could not reconcile with the repository yet: {exc}")
        self._install_master_snapshot(force=True)
        self._claim_safely()
        self.outer_loop.start()
        self._ready = True

    def _start_worker(self) -> None:
        self._apply_prepared_state()
        self._claim_safely()
        try:
            metadata = self.hub.global_metadata()
            if metadata is None:
                self._say(
                    "warning",
                    "worker could not find global/step_count.json; continuing from local weights",
                )
            elif metadata.outer_step > self._last_global_step:
                started = time.perf_counter()
                state = self.hub.read_global(metadata)
                self._install_state(state, metadata.outer_step, time.perf_counter() - started)
            else:
                self._ready = True
        except Exception as exc:
            self._say("warning", f"initial worker read failed; continuing locally: {exc}")

    def _claim_safely(self) -> None:
        try:
            self._check_owner(claim=True)
        except Exception as exc:
            self._say("warning", f"could not claim node_id {self.node_id}: {exc}")

    def _start_io_workers(self) -> None:
        if self.async_upload:
            self._upload_stop.clear()
            if self._upload_thread is None or not self._upload_thread.is_alive():
                self._upload_thread = threading.Thread(
                    target=self._upload_loop, name="speedtronic-diloco-upload", daemon=True
                )
                self._upload_thread.start()
            self._requeue_pending()
        if self.async_poll and self.role == "worker":
            self._poll_stop.clear()
            self._poll_thread = threading.Thread(
                target=self._poll_loop, name="speedtronic-diloco-poll", daemon=True
            )
            self._poll_thread.start()

    def _requeue_pending(self) -> None:
        with self._lock:
            job = self._pending_upload
            if job is None or self._upload_busy:
                return
            try:
                self._upload_queue.put_nowait(job)
                self._upload_busy = True
            except queue.Full:
                self._say("warning", "could not requeue pending delta upload")
                self._pending_upload = None

    def stop(self) -> None:
        """Stop accepting uploads, drain/join the I/O threads (bounded), stop the outer loop."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._accepting_uploads = False
            self._upload_stop.set()
            self._poll_stop.set()
            uploader, poller, outer = self._upload_thread, self._poll_thread, self.outer_loop
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
            self._poll_thread = None
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
    def _take_delta(self, step: int) -> DeltaUploadJob | None:
        current = T.cpu_state_dict(self.model.state_dict())
        with self._lock:
            baseline, generation = self._baseline, self._baseline_generation
            base, carry = self._last_global_step, self._carry
        try:
            delta = T.compute_pseudo_gradient(baseline, current)
        except ValueError as exc:
            self._say("error", f"cannot compute pseudo-gradient at step {step}: {exc}")
            return None
        if carry is not None:
            delta = (
                {k: v + carry[k] for k, v in delta.items()} if set(carry) == set(delta) else delta
            )
        if T.is_all_zero(delta):
            self._emit("delta_upload_zero", {"step": step})
            return None
        return DeltaUploadJob(step, base, generation, delta, current)

    def _push(self, step: int) -> bool:
        if not self._accepting_uploads:
            return False
        with self._lock:
            if self.async_upload and (self._upload_busy or self._pending_upload is not None):
                self._last_skipped_step = step
                self._emit("delta_upload_skipped", {"step": step, "reason": "upload_in_flight"})
                return False
        job = self._take_delta(step)
        if job is None:
            return False
        if not self.async_upload:
            with self._lock:
                self._carry = None
            self.phase = RoundPhase.PUSH
            return self._upload(job)
        with self._lock:
            if self._upload_busy or self._pending_upload is not None:
                self._emit("delta_upload_skipped", {"step": step, "reason": "upload_in_flight"})
                return False
            try:
                self._upload_queue.put_nowait(job)
            except queue.Full:
                self._last_skipped_step = step
                self._emit("delta_upload_skipped", {"step": step, "reason": "queue_full"})
                return False
            self._carry = None
            self._upload_busy, self._pending_upload = True, job
            self._last_dispatched_step = step
            self.phase = RoundPhase.PUSH
        self._emit("delta_upload_queued", {"step": step, "base_outer_step": job.base_outer_step})
        return True

    def _upload(self, job: DeltaUploadJob) -> bool:
        """Send one job (uploader thread, or the training thread in sync mode)."""
        started = time.perf_counter()
        try:
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
        except Exception as exc:
            with self._lock:  # carry the whole delta into the next push
                self._carry = (
                    job.delta
                    if self._carry is None
                    else {k: v + self._carry[k] for k, v in job.delta.items()}
                )
                if self._baseline_generation == job.generation:
                    self._baseline = job.target_state
            self._say(
                "warning",
                f"delta upload failed at step {job.step}; carried to the next round: {exc}",
            )
            self._emit(
                "delta_upload_failed", {"step": job.step, "error": scrub(str(exc), (self._token,))}
            )
            return False
        self.claim.claimed = True  # the upload commit carried our claim
        with self._lock:
            self._last_uploaded_step = job.step
            if self._baseline_generation == job.generation:
                self._baseline = job.target_state
            else:
                self._emit("delta_upload_stale", {"step": job.step, "generation": job.generation})
        self._emit(
            "delta_uploaded",
            {"step": job.step, "bytes": nbytes, "seconds": time.perf_counter() - started},
        )
        return True

    def _upload_loop(self) -> None:
        while not self._upload_stop.is_set() or not self._upload_queue.empty():
            try:
                job = self._upload_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._upload(job)
            finally:
                with self._lock:
                    self._upload_busy = False
                    if self._pending_upload is job:
                        self._pending_upload = None
                self._upload_queue.task_done()

    # COMMIT ---------------------------------------------------------------
    def _commit_global(self, boundary: bool) -> bool:
        """Install a newer global at a boundary (or when none is known yet)."""
        may_install = boundary or self._last_global_step < 0
        if self.role == "master":
            return self._install_master_snapshot(force=may_install)
        if self.async_poll:
            loaded = False
            if may_install:
                with self._lock:
                    candidate, self._global_candidate = self._global_candidate, None
                if candidate is not None and candidate.outer_step > self._last_global_step:
                    self._install_state(candidate.state, candidate.outer_step, candidate.seconds)
                    loaded = True
            self._schedule_poll(force=boundary)
            return loaded
        now = time.monotonic()
        if not may_install or (not boundary and now - self._last_poll < self.poll_interval):
            return False
        self._last_poll = now
        try:
            candidate = self._fetch_candidate()
        except Exception as exc:
            self._say("warning", f"global poll failed: {exc}")
            return False
        if candidate is None:
            return False
        self._install_state(candidate.state, candidate.outer_step, candidate.seconds)
        return True

    def _install_master_snapshot(self, force: bool) -> bool:
        snapshot = self._outer_snapshot
        if not force or snapshot is None or snapshot[0] <= self._last_global_step:
            return False
        self._install_state(snapshot[1], snapshot[0], 0.0)
        return True

    def _on_outer_update(self, state: dict[str, torch.Tensor], outer_step: int) -> None:
        self._outer_snapshot = (int(outer_step), state)  # one assignment: step and tensors agree

    def _fetch_candidate(self) -> GlobalCandidate | None:
        started = time.perf_counter()
        metadata = self.hub.global_metadata()
        with self._lock:
            known = max(
                self._last_global_step,
                self._global_candidate.outer_step if self._global_candidate else -1,
            )
        if metadata is None or metadata.outer_step <= known:
            return None
        state = self.hub.read_global(metadata)
        return GlobalCandidate(metadata.outer_step, state, time.perf_counter() - started)

    def _schedule_poll(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_interval:
            return
        with self._lock:
            if self._poll_thread is None or self._poll_busy:
                return
            self._last_poll = now
            try:
                self._poll_queue.put_nowait(True)
                self._poll_busy = True
            except queue.Full:
                pass

    def _poll_loop(self) -> None:
        while not self._poll_stop.is_set():
            try:
                self._poll_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            candidate = None
            try:
                candidate = self._fetch_candidate()
            except Exception as exc:
                self._say("warning", f"async global poll failed: {exc}")
            with self._lock:
                self._poll_busy = False
                if candidate is not None:
                    self._global_candidate = candidate
            self._poll_queue.task_done()

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
            self._baseline = T.cpu_state_dict(self.model.state_dict())
            self._baseline_generation += 1
            self._last_global_step = int(outer_step)
            self._ready = True
            self.phase = RoundPhase.SNAPSHOT
        self._emit("global_pulled", {"outer_step": int(outer_step), "seconds": float(seconds)})

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, baseline, carried delta, the pending job, and the master's outer state."""
        with self._lock:
            job = self._pending_upload
            return {
                "node_id": self.node_id,
                "role": self.role,
                "phase": self.phase.value,
                "last_global_step": self._last_global_step,
                "last_uploaded_step": self._last_uploaded_step,
                "last_dispatched_step": self._last_dispatched_step,
                "last_skipped_step": self._last_skipped_step,
                "local_step": self._local_step,
                "baseline_generation": self._baseline_generation,
                "baseline": T.cpu_state_dict(self._baseline),
                "carry": T.cpu_state_dict(self._carry) if self._carry is not None else None,
                "pending_upload": None if job is None else job.to_dict(),
                "outer": self.outer_loop.state_dict() if self.outer_loop is not None else None,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpointed state; a pending job is queued again when running."""
        with self._lock:
            self._restore(state)
            if self.outer_loop is not None and state.get("outer"):
                self.outer_loop.load_state_dict(state["outer"])
        if self._started and self.async_upload:
            self._requeue_pending()

    def prepare_state(self, state: Mapping[str, Any]) -> None:
        """Stage checkpointed state for the next ``start()`` (applied before any remote read)."""
        self._prepared_state = dict(state)

    def _apply_prepared_state(self) -> None:
        state, self._prepared_state = self._prepared_state, None
        if state is None:
            return
        with self._lock:
            self._restore(state)
            if self.outer_loop is not None and state.get("outer"):
                self.outer_loop.load_state_dict(state["outer"])
            if self._last_global_step >= 0:
                self._ready = True

    def _restore(self, state: Mapping[str, Any]) -> None:
        self._last_global_step = int(state.get("last_global_step", self._last_global_step))
        self._local_step = int(state.get("local_step", self._local_step))
        self._baseline_generation = int(state.get("baseline_generation", self._baseline_generation))
        for name in ("last_uploaded_step", "last_dispatched_step", "last_skipped_step"):
            setattr(self, f"_{name}", state.get(name))
        if state.get("baseline"):
            self._baseline = T.cpu_state_dict(state["baseline"])
        self._carry = T.cpu_state_dict(state["carry"]) if state.get("carry") else None
        job = state.get("pending_upload")
        if job:
            self._pending_upload = DeltaUploadJob.from_dict(job)
            self._upload_busy = False
        if state.get("phase") in {p.value for p in RoundPhase}:
            self.phase = RoundPhase(state["phase"])


DumbDiLoCo = DumbDiLoCoCoordinator
