"""The delta lane of a DumbDiLoCo node: what goes out at a round boundary.

:class:`DeltaLane` owns the baseline a delta is measured from (and its generation, bumped
whenever a global is installed), the delta taken at a boundary (``carry + baseline -
current``), the carry of a failed upload, and the upload itself: a one-slot queue feeding the
``speedtronic-diloco-upload`` daemon thread in async mode, or a call on the training thread
in sync mode. A failed upload is carried (its delta is added to the next one) and the
baseline still advances to the weights of that boundary, so every contribution reaches the
master once. A transport failure is state, never a crash.

The lane shares the coordinator's lock; the coordinator decides when to push and owns the
transport call (``send``), which carries the node's identity claim.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.rounds import DeltaUploadJob
from speedtronic.diloco.transport import scrub

__all__ = ["DeltaLane"]


class DeltaLane:
    """Baseline, carry, and the upload of one delta at a time (queued or synchronous)."""

    def __init__(
        self,
        baseline: dict[str, torch.Tensor],
        *,
        lock: threading.RLock,
        send: Callable[[DeltaUploadJob], int],
        emit: Callable[[str, dict[str, Any]], None],
        say: Callable[[str, str], None],
        token: str | None = None,
    ):
        self._lock = lock
        self._send = send  # one job to the transport; returns bytes sent, raises on failure
        self._emit = emit
        self._say = say
        self._token = token
        self.baseline = baseline
        self.generation = 0
        self.carry: dict[str, torch.Tensor] | None = None
        self.last_uploaded_step: int | None = None
        self.last_dispatched_step: int | None = None
        self.last_skipped_step: int | None = None
        self.queue: queue.Queue[DeltaUploadJob] = queue.Queue(maxsize=1)
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.busy = False
        self.pending: DeltaUploadJob | None = None

    # -- baseline ---------------------------------------------------------------
    def rebase(self, state: dict[str, torch.Tensor]) -> None:
        """A global was installed: measure from ``state``; jobs already out become stale."""
        with self._lock:
            self.baseline = state
            self.generation += 1

    # -- taking the delta ---------------------------------------------------------------
    def take_delta(
        self, step: int, current: dict[str, torch.Tensor], base_outer_step: int
    ) -> DeltaUploadJob | None:
        """``carry + (baseline - current)`` as a job, or None (error, or nothing changed)."""
        with self._lock:
            baseline, generation, carry = self.baseline, self.generation, self.carry
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
        return DeltaUploadJob(step, base_outer_step, generation, delta, current)

    # -- dispatch ---------------------------------------------------------------
    def skip_if_in_flight(self, step: int) -> bool:
        """Async mode: a boundary that finds a job in flight is skipped (True)."""
        with self._lock:
            if self.busy or self.pending is not None:
                self.last_skipped_step = step
                self._emit("delta_upload_skipped", {"step": step, "reason": "upload_in_flight"})
                return True
        return False

    def clear_carry(self) -> None:
        """Sync mode: the carry is part of the job about to be uploaded."""
        with self._lock:
            self.carry = None

    def enqueue(self, job: DeltaUploadJob) -> bool:
        """Async mode: put ``job`` in the one slot; False (and an event) if it is taken."""
        with self._lock:
            if self.busy or self.pending is not None:
                self._emit("delta_upload_skipped", {"step": job.step, "reason": "upload_in_flight"})
                return False
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                self.last_skipped_step = job.step
                self._emit("delta_upload_skipped", {"step": job.step, "reason": "queue_full"})
                return False
            self.carry = None
            self.busy, self.pending = True, job
            self.last_dispatched_step = job.step
            return True

    # -- upload ---------------------------------------------------------------
    def upload(self, job: DeltaUploadJob) -> bool:
        """Send one job (uploader thread, or the training thread in sync mode)."""
        started = time.perf_counter()
        try:
            nbytes = self._send(job)
        except Exception as exc:
            with self._lock:  # carry the whole delta into the next push
                self.carry = (
                    job.delta
                    if self.carry is None
                    else {k: v + self.carry[k] for k, v in job.delta.items()}
                )
                if self.generation == job.generation:
                    self.baseline = job.target_state
            self._say(
                "warning",
                f"delta upload failed at step {job.step}; carried to the next round: {exc}",
            )
            self._emit(
                "delta_upload_failed", {"step": job.step, "error": scrub(str(exc), (self._token,))}
            )
            return False
        with self._lock:
            self.last_uploaded_step = job.step
            if self.generation == job.generation:
                self.baseline = job.target_state
            else:
                self._emit("delta_upload_stale", {"step": job.step, "generation": job.generation})
        self._emit(
            "delta_uploaded",
            {"step": job.step, "bytes": nbytes, "seconds": time.perf_counter() - started},
        )
        return True

    # -- the uploader thread ---------------------------------------------------------------
    def start(self) -> None:
        """Start (or keep) the uploader thread and queue a pending job again."""
        self.stop_event.clear()
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(
                target=self._loop, name="speedtronic-diloco-upload", daemon=True
            )
            self.thread.start()
        self.requeue_pending()

    def requeue_pending(self) -> None:
        """Queue the pending job (restored or interrupted) unless one is in flight."""
        with self._lock:
            job = self.pending
            if job is None or self.busy:
                return
            try:
                self.queue.put_nowait(job)
                self.busy = True
            except queue.Full:
                self._say("warning", "could not requeue pending delta upload")
                self.pending = None

    def _loop(self) -> None:
        while not self.stop_event.is_set() or not self.queue.empty():
            try:
                job = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.upload(job)
            finally:
                with self._lock:
                    self.busy = False
                    if self.pending is job:
                        self.pending = None
                self.queue.task_done()

    # -- state ---------------------------------------------------------------
    def restore(self, state: Mapping[str, Any]) -> None:
        """Generation, step counters, baseline, carry and the pending job of a checkpoint."""
        with self._lock:
            self.generation = int(state.get("baseline_generation", self.generation))
            self.last_uploaded_step = state.get("last_uploaded_step")
            self.last_dispatched_step = state.get("last_dispatched_step")
            self.last_skipped_step = state.get("last_skipped_step")
            if state.get("baseline"):
                self.baseline = T.cpu_state_dict(state["baseline"])
            self.carry = T.cpu_state_dict(state["carry"]) if state.get("carry") else None
            job = state.get("pending_upload")
            if job:
                self.pending = DeltaUploadJob.from_dict(job)
                self.busy = False
