"""The node side of a DiLoCo round, top to bottom, hooked on the inner optimizer's step.

A node keeps an *anchor*: the float32 weights its next contribution is measured from (the
installed global, or its own weights at its last upload). After every applied optimizer step
(``Optimizer.register_step_post_hook``, as torchft's ``local_sgd.py`` does)::

    count the step; merge a waiting newer global if the node already contributed for its base
    every ``inner_steps`` steps (a boundary):
        overlapped: wait (<= round_timeout) for the global of the previous contribution
        contribution = carry + anchor - weights            (float32, the pseudo-gradient)
        round        = max(installed outer step, last uploaded round + 1)
        anchor := weights; upload (background thread when overlapped and async)
        blocking: wait (<= round_timeout) for the global that includes the contribution
    merge global G:  weights := G + (weights - anchor);  anchor := G

The merge keeps every step of progress made since the upload and counts none twice (in
blocking mode there is none, and the merge is a plain install). A newer global that arrives
before the node contributed for its current base is held until the node's boundary: that
contribution is then late, and the master folds it into the open round when it is at most
``max_staleness`` rounds old. A failed upload is carried into the next contribution (the
final one is sent again, up to ``FINAL_UPLOAD_ATTEMPTS`` times). At the end of a run,
:meth:`DiLoCoNode.finish` uploads the last contribution marked final together with a ``done``
status, waits for the global that includes it and installs it, so the node's
final checkpoint holds it. Network failures are state (logged, counted, carried), never a
crash of the training loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from speedtronic.config.errors import ConfigError
from speedtronic.diloco import tensors as T
from speedtronic.diloco.mailbox import (
    Contribution,
    Emit,
    GlobalCandidate,
    GlobalInbox,
    Uploader,
    ignore,
)
from speedtronic.diloco.retry import ExchangeError, TransportError

__all__ = ["Contribution", "DiLoCoNode", "GlobalCandidate", "GlobalInbox"]

_LOG = logging.getLogger("speedtronic.diloco")

# The final contribution has no next round to be carried into: finish() sends it this many
# times (each with the transport's own retries) before it gives up and says so.
FINAL_UPLOAD_ATTEMPTS = 3


class DiLoCoNode:
    """The round of one node (see the module docstring).

    ``send(contribution)`` performs the upload (raising on failure); ``inbox`` delivers new
    globals; ``emit`` reports events (log lines go to the ``speedtronic.diloco`` logger).
    ``settings`` is the ``distributed``
    config section (``inner_steps``, ``sync``, ``round_timeout``, ``reset_inner_optimizer``,
    ``async_delta_upload``, ``delta_upload_shutdown_timeout``).
    """

    def __init__(
        self,
        settings: Any,
        model: torch.nn.Module,
        *,
        send: Callable[[Contribution], int],
        inbox: GlobalInbox,
        emit: Emit = ignore,
    ):
        self.settings = settings
        self.model = model
        self.inbox = inbox
        self._emit = emit
        self._send = send
        threaded = settings.sync == "overlapped" and settings.async_delta_upload
        self.uploads = Uploader(self._upload, threaded=threaded)
        self._lock = threading.RLock()
        self.optimizer: torch.optim.Optimizer | None = None
        self._hook: Any = None
        self.step = 0  # optimizer steps applied (absolute)
        self.inner = 0  # steps since the last contribution
        self.installed = -1  # outer step of the installed global (-1: none yet)
        self.run_id = ""  # the run of the installed global
        self.last_round = -1  # round of the last upload that arrived (-1: none yet)
        self.anchor = _float_state(model)
        self.carry: dict[str, torch.Tensor] | None = None
        self.done = False
        self.final_seen = False
        self.finishing = False  # finish() runs: the final global is expected now
        self.fatal: Exception | None = None  # a permanent upload failure
        self.interrupted = threading.Event()
        self.last_heartbeat = time.monotonic()

    # -- wiring ---------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Run the round after every applied ``optimizer.step()`` (idempotent)."""
        if self.optimizer is optimizer:
            return
        self.detach()
        self.optimizer = optimizer
        self._hook = optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer`` for the round's state resets, without a hook: the caller runs
        :meth:`after_optimizer_step` itself (a sharded node, after refreshing its copy)."""
        self.detach()
        self.optimizer = optimizer

    def detach(self) -> None:
        """Remove the optimizer hook."""
        if self._hook is not None:
            self._hook.remove()
        self._hook, self.optimizer = None, None

    def beat(self) -> None:
        """Refresh the liveness heartbeat (also while waiting for a global)."""
        self.last_heartbeat = time.monotonic()

    # -- the per-step hook ------------------------------------------------------------------
    def wants_weights(self) -> bool:
        """Whether the next :meth:`after_optimizer_step` reads or writes the weights: a round
        boundary is due, or a waiting global may be merged. A node whose weights are a copy
        (sharded ranks) refreshes the copy only then."""
        due = self.inner + 1 >= self.settings.inner_steps
        return due or (self.may_merge() and self.inbox.waiting_step() >= 0)

    def after_optimizer_step(self, *, weights_current: bool = True) -> bool:
        """One applied inner step; True when a global was merged into the weights.

        ``weights_current=False`` (the model is a copy that was not refreshed this step, see
        :meth:`wants_weights`) leaves a waiting global for a later step."""
        self._raise_fatal()
        self.step += 1
        self.inner += 1
        self.beat()
        self.inbox.poll_due()
        may_merge = weights_current and self.may_merge()
        merged = self.merge_waiting() if may_merge else False
        if self.inner >= self.settings.inner_steps:
            merged = self._boundary(final=False) or merged
        return merged

    def _raise_fatal(self) -> None:
        """An upload failed permanently (auth refused, path not writable): stop the node."""
        if isinstance(self.fatal, ConfigError):  # e.g. a node id collision
            raise self.fatal
        if self.fatal is not None:
            raise ExchangeError(
                f"distributed.repo_id: the exchange refused an upload: {self.fatal}"
            )

    def may_merge(self) -> bool:
        """A newer global is merged once the node contributed for its installed base."""
        return self.installed < 0 or self.last_round >= self.installed

    def _boundary(self, *, final: bool) -> bool:
        """Take and upload this round's contribution; wait for its global when blocking."""
        merged = False
        if self.settings.sync == "overlapped" and 0 <= self.installed <= self.last_round:
            merged = self._await_global(self.last_round + 1, self.settings.round_timeout)
        self.uploads.drain()
        current = _float_state(self.model)
        delta = T.compute_pseudo_gradient(self.anchor, current)
        with self._lock:
            if self.carry is not None:
                delta = {k: v.add_(self.carry[k]) for k, v in delta.items()}
                self.carry = None
            self.anchor = current
            self.inner = 0
        if T.is_all_zero(delta):
            self._emit("delta_upload_zero", step=self.step)
            if final:
                self.uploads.submit(self._done_record())
            return merged
        # a round is used up only by an upload that arrived (see _upload): after a failure
        # the carried progress goes out under the same round, so an outage never
        # pushes a node's rounds ahead of the master's
        round = max(self.installed, self.last_round + 1)
        job = Contribution(round, self.installed, self.step, delta, final, self.run_id)
        self.uploads.submit(job)
        if self.settings.sync == "blocking" or final:
            uploaded = self.uploads.drain() and self.carry is None
            self._raise_fatal()
            if uploaded:
                timeout = self.settings.round_timeout * (2 if final else 1)
                merged = self._await_global(round + 1, timeout) or merged
        return merged

    def _upload(self, job: Contribution) -> None:
        started = time.perf_counter()
        try:
            nbytes = self._send(job)
        except Exception as exc:
            permanent = isinstance(exc, TransportError) and exc.kind == "permanent"
            if permanent or isinstance(exc, ConfigError):
                self.fatal = exc  # raised on the training thread at its next step
            if job.delta is not None:
                with self._lock:  # the whole contribution goes into the next one
                    self.carry = (
                        job.delta
                        if self.carry is None
                        else {k: v + self.carry[k] for k, v in job.delta.items()}
                    )
            _LOG.warning(
                f"delta upload for round {job.round} failed; carried to the next one: {exc}"
            )
            self._emit("delta_upload_failed", step=job.step, round=job.round, error=str(exc))
            return
        with self._lock:
            self.last_round = max(self.last_round, job.round)
        if job.delta is not None:
            self._emit(
                "delta_uploaded",
                step=job.step,
                round=job.round,
                base_outer_step=job.base,
                bytes=nbytes,
                seconds=time.perf_counter() - started,
                final=job.final,
            )

    # -- globals ------------------------------------------------------------------------
    def merge_waiting(self) -> bool:
        candidate = self.inbox.take()
        if candidate is None:
            return False
        same = candidate.outer_step == self.installed and not self._new_run(candidate)
        if same and not candidate.final:
            return False
        self.merge(candidate)
        return True

    def _await_global(self, round: int, timeout: float) -> bool:
        """Wait (bounded, interruptible) until a global with outer step >= ``round`` is
        merged; newer globals met on the way are merged too. True when one was merged."""
        started = time.monotonic()
        deadline = started + timeout
        self.inbox.poke()
        merged = False
        run = self.run_id
        while True:
            merged = self.merge_waiting() or merged
            if self.installed >= round or self.last_round < 0 or self.run_id != run:
                break  # arrived, or a new run started (its round count begins again)
            now = time.monotonic()
            if self.interrupted.is_set() or now >= deadline:
                break
            self.beat()
            self.inbox.wait(min(0.5, deadline - now))
        waited = time.monotonic() - started
        timed_out = self.installed < round
        self._emit("sync_wait", outer_step=round, seconds=waited, timed_out=timed_out)
        # a new run (reported by merge) or a stop request ends the wait without a timeout
        if timed_out and self.run_id == run and not self.interrupted.is_set():
            _LOG.warning(
                f"global {round} did not arrive within {waited:.1f} s of waiting (bound "
                f"{timeout:.0f} s from distributed.round_timeout); training on (it is merged "
                "when it arrives)",
            )
        self.beat()
        return merged

    def _check_fits(self, candidate: GlobalCandidate) -> None:
        """The global must hold exactly this model's tensors (a node with another model
        config would train on a mix): otherwise :class:`ExchangeError`, exit code 2."""
        mine = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        theirs = {k: tuple(v.shape) for k, v in candidate.state.items()}
        if mine == theirs:
            return
        diff = sorted(set(mine) ^ set(theirs)) or sorted(k for k in mine if mine[k] != theirs[k])
        key = diff[0]
        raise ExchangeError(
            f"the global (outer step {candidate.outer_step}) does not fit this node's model: "
            f"{key} is {mine.get(key, 'absent')} here and {theirs.get(key, 'absent')} in the "
            "global; every node needs the same model config"
        )

    def _new_run(self, candidate: GlobalCandidate) -> bool:
        """The candidate starts another run (a new run id, or an outer step going back)."""
        if self.installed < 0:
            return False
        other = bool(candidate.run_id and self.run_id and candidate.run_id != self.run_id)
        return other or candidate.outer_step < self.installed

    @torch.no_grad()
    def merge(self, candidate: GlobalCandidate) -> None:
        """``weights := G + (weights - anchor)``; ``anchor := G`` (training thread only).

        A global of another run is installed as it is: progress, carry and round numbers of
        the old run do not belong to the new one.
        """
        self._check_fits(candidate)
        if self._new_run(candidate):
            _LOG.warning(
                f"a new run started on the exchange (global {candidate.outer_step}, run "
                f"{candidate.run_id or '?'}); restarting the round count from it",
            )
            with self._lock:
                self.last_round, self.carry, self.inner = -1, None, 0
                self.anchor = _float_state(self.model)  # progress since here is dropped
            self.installed = -1
        state = self.model.state_dict()
        anchor: dict[str, torch.Tensor] = {}
        updates: dict[str, torch.Tensor] = {}
        for key, value in candidate.state.items():
            target = state.get(key)
            if target is None or tuple(target.shape) != tuple(value.shape):
                continue
            if key in self.anchor:  # every value is computed before any is written (tied weights)
                progress = target.to(torch.float32) - self.anchor[key].to(target.device)
                updates[key] = value.to(target.device, torch.float32, copy=True).add_(progress)
                anchor[key] = T.cpu_tensor(value).to(torch.float32)
            else:
                updates[key] = value
        for key, value in updates.items():
            state[key].copy_(value.to(state[key].device, state[key].dtype))
        with self._lock:
            self.anchor.update(anchor)
            self.installed = candidate.outer_step
            self.run_id = candidate.run_id or self.run_id
            self.final_seen = self.final_seen or candidate.final
        if self.settings.reset_inner_optimizer and self.optimizer is not None:
            reset = getattr(self.optimizer, "reset_state", None)
            reset() if callable(reset) else self.optimizer.state.clear()
        self._emit(
            "global_pulled",
            outer_step=candidate.outer_step,
            seconds=candidate.seconds,
            step=self.step,
        )

    # -- end of run -----------------------------------------------------------------------
    def finish(self) -> None:
        """The run reached its target: final contribution + ``done``; install its global."""
        if self.done:
            return
        self.finishing = True
        if self.inner > 0 or self.carry is not None:
            self._boundary(final=True)
            # a failed final upload has no next round to be carried into: send it again
            for _ in range(FINAL_UPLOAD_ATTEMPTS - 1):
                if self.carry is None or self.fatal is not None:
                    break
                self._boundary(final=True)
            if self.carry is not None:  # not done: a resumed node's finish() sends it
                _LOG.error(
                    f"the final contribution could not be uploaded after "
                    f"{FINAL_UPLOAD_ATTEMPTS} attempts; it is in this node's checkpoint and a "
                    "restart with --resume sends it",
                )
                return
        else:
            self.uploads.drain()
            self.uploads.submit(self._done_record())
            self.uploads.drain()
            if self.last_round >= 0 and self.installed <= self.last_round:
                self._await_global(self.last_round + 1, 2 * self.settings.round_timeout)
        self.done = True  # nothing is left to send

    def _done_record(self) -> Contribution:
        """Nothing left to contribute: only the ``done`` status (after the last round)."""
        return Contribution(self.last_round, self.installed, self.step, None, True, self.run_id)

    def stop(self) -> bool:
        """Let an upload in flight finish (bounded); True when nothing is left pending."""
        return self.uploads.stop(self.settings.delta_upload_shutdown_timeout)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, anchor, carry and the upload in flight (re-sent on resume)."""
        with self._lock:
            pending = self.uploads.pending
            return {
                "format": "speedtronic-diloco-node/2",
                "step": self.step,
                "inner": self.inner,
                "installed": self.installed,
                "run_id": self.run_id,
                "last_round": self.last_round,
                "last_label": self.last_round,  # the key readers of this format knew first
                "anchor": T.cpu_state_dict(self.anchor),
                "carry": None if self.carry is None else T.cpu_state_dict(self.carry),
                "pending": None if pending is None else pending.to_dict(),
                "done": self.done,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> Contribution | None:
        """Restore a checkpointed state; returns the contribution that was still in flight
        (the caller sends it again: the master recognises a replay by its round)."""
        if state.get("format") != "speedtronic-diloco-node/2":
            _LOG.warning("checkpoint holds DiLoCo state of another format; ignored")
            return None
        with self._lock:
            self.step = int(state["step"])
            self.inner = int(state["inner"])
            self.installed = int(state["installed"])
            self.run_id = str(state.get("run_id", ""))
            self.last_round = int(state.get("last_round", state.get("last_label", -1)))
            self.anchor = T.cpu_state_dict(state["anchor"])
            carry = state.get("carry")
            self.carry = None if carry is None else T.cpu_state_dict(carry)
            self.done = bool(state.get("done", False))
        pending = state.get("pending")
        return None if pending is None else Contribution.from_dict(pending)


def _float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Float32 CPU copies of the floating-point entries of ``model.state_dict()``."""
    return {
        key: value.detach().to("cpu", torch.float32, copy=True)
        for key, value in model.state_dict().items()
        if value.is_floating_point()
    }
