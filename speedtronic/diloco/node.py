"""The node side of a DiLoCo round, top to bottom, hooked on the inner optimizer's step.

A node keeps an *anchor*: the float32 weights its next contribution is measured from (the
installed global, or its own weights at its last upload). After every applied optimizer step
(``Optimizer.register_step_post_hook``, as torchft's ``local_sgd.py`` does)::

    count the step; merge a waiting newer global if the node already contributed for its base
    every ``inner_steps`` steps (a boundary):
        overlapped: wait (<= round_timeout) for the global of the previous contribution
        contribution = anchor - weights + carry + residual  (float32, the pseudo-gradient,
                       in the old anchor's buffers)
        round        = max(installed outer step, last uploaded round + 1)
        sent         = the contribution as the wire carries it (delta_dtype: fp32 exact;
                       bf16/fp16 cast; int8/int4 blockwise codes + scales), encoded tensor
                       by tensor as the upload's file is written
        anchor := weights; upload (background thread when overlapped and async)
        upload arrived: residual = contribution - decode(sent), in the contribution's
                       buffers (error feedback; fp32: none)
        blocking: wait (<= round_timeout) for the global that includes the contribution
    merge global G:  weights := G + (weights - anchor);  anchor := G  (in place)

The merge counts every step of progress made since the upload exactly once. A newer global
that arrives before the node contributed for its current base is held until the boundary:
that contribution is late, and the master folds it into the open round when it is at most
``max_staleness`` rounds old. A failed upload is carried whole (residual included) into the
next contribution, so nothing is counted twice; the final one is sent again, up to
``FINAL_UPLOAD_ATTEMPTS`` times, with a ``done`` status, and :meth:`DiLoCoNode.finish` installs
the global that includes it. Network failures are state (logged, counted, carried), never a
crash of the training loop. Below the round: what passes between the training thread and
the exchange, the node's link to the exchange (:class:`NodeLink`) and its identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from speedtronic.background import Loop, wait_for
from speedtronic.config import ConfigError, DistributedConfig
from speedtronic.config.limits import check_node_id
from speedtronic.diloco import codec
from speedtronic.diloco import exchange as T
from speedtronic.diloco.exchange import (
    AccessRefused,
    Emit,
    ExchangeError,
    FileInfo,
    RemoteNotFound,
    Store,
    TransportError,
    ignore,
    scrub,
)
from speedtronic.diloco.master import HeldGlobal, read_update, syncs_momentum

__all__ = [
    "Contribution",
    "DiLoCoNode",
    "ExchangeAccessError",
    "GlobalCandidate",
    "GlobalInbox",
    "NodeClaim",
    "NodeIdCollisionError",
    "NodeLink",
    "Uploader",
    "first_moments",
    "float_state",
    "install_first_moments",
    "resolve_node_id",
]

_LOG = logging.getLogger("speedtronic.diloco")

#: A checkpointed state: tensors, numbers, strings and nested states of them.
Checkpoint = Mapping[str, Any]
#: A node's status record on the exchange (``nodes/<id>/owner.json``), as JSON.
Record = Mapping[str, object]

# The final contribution has no next round to be carried into: finish() sends it this many
# times (each with the transport's own retries) before it gives up and says so.
FINAL_UPLOAD_ATTEMPTS = 3


class DiLoCoNode:
    """The round of one node (see the module docstring): ``send`` uploads a contribution
    (raising on failure) and returns its bytes; ``inbox`` delivers new globals."""

    def __init__(
        self,
        settings: DistributedConfig,
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
        self._hook: RemovableHandle | None = None
        self.step = 0  # optimizer steps applied (absolute)
        self.inner = 0  # steps since the last contribution
        self.installed = -1  # outer step of the installed global (-1: none yet)
        self.run_id = ""  # the run of the installed global
        self.last_round = -1  # round of the last upload that arrived (-1: none yet)
        self.anchor = float_state(model)
        self.carry: dict[str, torch.Tensor] | None = None
        # what the wire format left out of the last contribution that arrived (error feedback)
        self.residual: dict[str, torch.Tensor] | None = None
        self.done = False
        self.final_seen = False
        # the round whose upload carried this node's first moments, and their parameters
        self.moments_sent: SentMoments | None = None
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
        self._hook = optimizer.register_step_post_hook(self._on_step)

    def _on_step(self, *_: object) -> None:
        self.after_optimizer_step()

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
        """Whether the next :meth:`after_optimizer_step` reads or writes the weights (a
        boundary is due, or a waiting global may be merged): a sharded rank refreshes its
        copy only then."""
        due = self.inner + 1 >= self.settings.inner_steps
        return due or (self.may_merge() and self.inbox.waiting_step() >= 0)

    def after_optimizer_step(self, *, weights_current: bool = True) -> bool:
        """One applied inner step; True when a global was merged into the weights.
        ``weights_current=False`` (a copy not refreshed this step) leaves a waiting global."""
        self._raise_fatal()
        self.step += 1
        self.inner += 1
        self.beat()
        self.inbox.poll_due()
        merged = self.merge_waiting() if weights_current and self.may_merge() else False
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
        with self._lock:
            delta, self.anchor = self._take_contribution()
            self.inner = 0
        if codec.is_all_zero(delta):
            self._emit("delta_upload_zero", step=self.step)
            if final:
                self._send_done()
            return merged
        # a round is used up only by an upload that arrived (see _upload): carried progress
        # goes out under the same round, so an outage never pushes rounds past the master's
        round = max(self.installed, self.last_round + 1)
        s = self.settings
        if self.optimizer is not None and syncs_momentum(
            s.sync_inner_momentum, s.inner_momentum_every, round + 1
        ):  # the first moments travel with the delta, without error feedback
            moments = first_moments(self.model, self.optimizer)
            delta.update({codec.MOMENT_PREFIX + k: v for k, v in moments.items()})
        job = Contribution(round, self.installed, self.step, delta, final, self.run_id)
        if self.settings.delta_dtype != "fp32":  # what it leaves out: the residual (_upload)
            job.wire = codec.EncodedView(
                delta, self.settings.delta_dtype, self.settings.delta_block_size
            )
        self.uploads.submit(job)
        del job, delta  # the wait below holds no copy of the contribution (nor the uploader)
        if self.settings.sync == "blocking" or final:
            uploaded = self.uploads.drain() and self.carry is None
            self._raise_fatal()
            if uploaded:
                timeout = self.settings.round_timeout * (2 if final else 1)
                merged = self._await_global(round + 1, timeout) or merged
        return merged

    def _take_contribution(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(anchor - weights) + carry + residual`` in the old anchor's buffers, and the new
        anchor (the weights, float32), one tensor at a time: the carry and the residual are
        let go as the new anchor grows, so the node never holds a third copy of the model."""
        state = self.model.state_dict()
        current = {key: value for key, value in state.items() if value.is_floating_point()}
        extras = [dict(x) for x in (self.carry, self.residual) if x is not None]
        self.carry = self.residual = None
        codec.check_like(self.anchor, current, what="the model does not match its anchor")
        anchor: dict[str, torch.Tensor] = {}
        for key, delta in self.anchor.items():
            anchor[key] = current[key].detach().to("cpu", torch.float32, copy=True)
            delta.sub_(anchor[key])
            for extra in extras:
                delta.add_(extra.pop(key))
        return self.anchor, anchor

    def _upload(self, job: Contribution) -> None:
        """Send ``job``. Arrived: its round is used up and the wire's leftover becomes the
        residual. Failed: the whole contribution is carried (no residual), or, permanent,
        kept in :attr:`fatal` for the training thread to raise."""
        started = time.perf_counter()
        try:
            nbytes = self._send(job)
        except Exception as exc:
            permanent = isinstance(exc, TransportError) and exc.kind == "permanent"
            if permanent or isinstance(exc, ConfigError):
                self.fatal = exc  # raised on the training thread at its next step
            if job.delta is None:  # only the done status: nothing to carry
                _LOG.warning(f"the done status after round {job.round} was not uploaded: {exc}")
                self._emit("status_upload_failed", step=job.step, round=job.round, error=str(exc))
                return
            delta = codec.without_moments(job.delta)
            with self._lock:
                carry = self.carry
                self.carry = delta if carry is None else {k: v + carry[k] for k, v in delta.items()}
            _LOG.warning(
                f"delta upload for round {job.round} failed; carried to the next one: {exc}"
            )
            self._emit("delta_upload_failed", step=job.step, round=job.round, error=str(exc))
            return
        with self._lock:
            self.last_round = max(self.last_round, job.round)
            job.arrived = True  # a checkpoint no longer holds it (its buffers are reused)
            if isinstance(job.wire, codec.EncodedView) and self.settings.error_feedback:
                # in the contribution's buffers
                self.residual = codec.without_moments(job.wire.keep_residual())
            names = [k[len(codec.MOMENT_PREFIX) :] for k in job.delta or () if codec.is_moment(k)]
            if names:
                self.moments_sent = SentMoments(job.round, frozenset(names))
        codec.return_free_memory()  # the encoder's and the writer's slices
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
        """Merge the waiting global, if any and new; True when one was merged."""
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

        def arrived() -> bool:  # or a new run started (its round count begins again)
            nonlocal merged
            merged = self.merge_waiting() or merged
            return self.installed >= round or self.last_round < 0 or self.run_id != run

        def waited() -> bool:
            if arrived():
                return True
            self.beat()
            self.inbox.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))
            return arrived()

        wait_for(waited, timeout=timeout, interval=0.0, stop=self.interrupted)
        waited_s = time.monotonic() - started
        timed_out = self.installed < round
        self._emit("sync_wait", outer_step=round, seconds=waited_s, timed_out=timed_out)
        # a new run (reported by merge) or a stop request ends the wait without a timeout
        if timed_out and self.run_id == run and not self.interrupted.is_set():
            # say who waits for whom: on the master, its own node waits for its own round
            source = f"the master has not closed round {round - 1} yet"
            if self.settings.role == "master":
                source = f"this master has not closed round {round - 1} yet: it still waits "
                source += "for other nodes' contributions"
            _LOG.warning(
                f"this node waited {waited_s:.1f} s for global {round} (bound {timeout:.0f} s "
                f"from distributed.round_timeout): {source}; training on, the global is merged "
                "when it arrives"
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
        """``weights := G + (weights - anchor)``; ``anchor := G`` (training thread only). A
        global of another run is installed as it is: the old run's progress, carry, residual
        and round numbers do not belong to the new one."""
        self._check_fits(candidate)
        if self._new_run(candidate):
            _LOG.warning(
                f"a new run started on the exchange (global {candidate.outer_step}, run "
                f"{candidate.run_id or '?'}); restarting the round count from it",
            )
            with self._lock:
                self.last_round, self.carry, self.residual, self.inner = -1, None, None, 0
                self.anchor = float_state(self.model)  # progress since here is dropped
            self.installed = -1
        with self._lock:
            self._install(candidate.state)
            self.installed = candidate.outer_step
            self.run_id = candidate.run_id or self.run_id
            self.final_seen = self.final_seen or candidate.final
        codec.return_free_memory()  # the download's and the slices' pages
        if self.settings.reset_inner_optimizer and self.optimizer is not None:
            self.optimizer.state.clear()
        sent, moments = self.moments_sent, candidate.moments
        if moments is not None and sent is not None and sent.round == moments[0]:
            # the mean of the round this node sent its own to; any other round's: kept its own
            self._install_moments(candidate.outer_step, moments[0], moments[1], sent)
            self.moments_sent = None
        self._emit(
            "global_pulled",
            outer_step=candidate.outer_step,
            seconds=candidate.seconds,
            step=self.step,
            source=candidate.source,
            bytes=candidate.nbytes,
        )

    def _install_moments(
        self, outer_step: int, round: int, moments: Mapping[str, torch.Tensor], sent: SentMoments
    ) -> None:
        """Install the mean first ``moments`` of ``round`` when they are the moments of the
        parameters this node sent, with their shapes, finite in their dtypes and within the
        bound of a contribution's values; otherwise refuse them (an error and a
        ``moments_rejected`` event) and keep the node's own."""
        if self.optimizer is None:
            return
        params = {name: p for name, p in _named_params(self.model) if name in sent.names}
        try:
            codec.check_like(params, moments, what="the mean first moments do not fit")
            bad = codec.first_non_finite(moments, like=params, max_abs=codec.MAX_DELTA_ABS)
            if bad is not None:
                raise ValueError(
                    f"{bad} holds values that are not finite in its parameter's dtype or "
                    f"beyond ±{codec.MAX_DELTA_ABS:g} (the bound of a contribution's values)"
                )
        except ValueError as exc:
            _LOG.error(
                f"refusing the mean first moments of round {round} published with global "
                f"{outer_step}: {exc}; this node keeps its own and trains on"
            )
            self._emit("moments_rejected", outer_step=outer_step, round=round, error=str(exc))
            return
        install_first_moments(self.model, self.optimizer, moments)

    def _install(self, global_state: Mapping[str, torch.Tensor]) -> None:
        """``weights := G + (weights - anchor)``, ``anchor := G``, tensor by tensor and in
        place. A tensor the model holds under several keys (tied weights) is written once,
        from its first key: all its keys hold the same values."""
        state = self.model.state_dict()
        written: set[tuple[object, ...]] = set()
        for key, value in global_state.items():
            target = state.get(key)
            if target is None or tuple(target.shape) != tuple(value.shape):
                continue
            anchor = self.anchor.get(key)
            identity = (target.data_ptr(), target.dtype, tuple(target.shape), target.stride())
            if identity not in written:
                written.add(identity)
                if anchor is None:  # not a float entry: installed as it is
                    target.copy_(value.to(target.device, target.dtype))
                    continue
                _merge_into(target, anchor, value)
            if anchor is not None:
                anchor.copy_(value)

    # -- end of run -----------------------------------------------------------------------
    def finish(self) -> None:
        """The run reached its target: final contribution + ``done``; install its global."""
        if self.done:
            return
        self.finishing = True
        if self.inner > 0 or self.carry is not None:
            # a failed final upload has no next round to be carried into: send it again
            for _ in range(FINAL_UPLOAD_ATTEMPTS):
                self._boundary(final=True)
                if self.carry is None or self.fatal is not None:
                    break
            if self.carry is not None:  # not done: a resumed node's finish() sends it
                self._raise_fatal()  # unless no retry or resume can: exit 2, one line
                _LOG.error(
                    f"the final contribution could not be uploaded after "
                    f"{FINAL_UPLOAD_ATTEMPTS} attempts; it is in this node's checkpoint and a "
                    "restart with --resume sends it",
                )
                return
        else:
            self.uploads.drain()
            self._send_done()
            self._raise_fatal()
            if self.last_round >= 0 and self.installed <= self.last_round:
                self._await_global(self.last_round + 1, 2 * self.settings.round_timeout)
            if self.settings.final_average > 1 and self.inbox.fetches:
                self._await_final(2 * self.settings.round_timeout)
        self.done = True  # nothing is left to send

    def _await_final(self, timeout: float) -> None:
        """Wait (bounded, interruptible) for the final global and install it. With
        ``final_average`` > 1 it is the mean of the last globals, published once every node
        is done, under the outer step of the last global this node holds: the inbox forgets
        what it saw, so that it reads the global again until the record says final."""

        def installed() -> bool:
            self.merge_waiting()
            if not self.final_seen:
                self.beat()
                self.inbox.forget()
                self.inbox.poke()
                self.inbox.poll_due()
            return self.final_seen

        pause = min(self.settings.poll_interval, 1.0)
        if not wait_for(installed, timeout=timeout, interval=pause, stop=self.interrupted):
            _LOG.warning(
                f"no final global within {timeout:.0f} s; this node keeps the last global "
                "(distributed.final_average: the final model is in the master's final/)"
            )

    def _send_done(self) -> None:
        """Nothing left to contribute: upload only the ``done`` status (without it the master
        waits ``drop_after`` round lengths for this node), up to ``FINAL_UPLOAD_ATTEMPTS``
        times, like a final contribution."""
        for _ in range(FINAL_UPLOAD_ATTEMPTS):
            record = Contribution(
                self.last_round, self.installed, self.step, None, True, self.run_id
            )
            self.uploads.submit(record)
            self.uploads.drain()
            if record.arrived or self.fatal is not None:
                return

    def stop(self) -> bool:
        """Let an upload in flight finish (bounded); True when nothing is left pending."""
        return self.uploads.drain(self.settings.delta_upload_shutdown_timeout)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Counters, anchor, carry, the error-feedback residual and the upload in flight
        (re-sent on resume)."""
        with self._lock:
            pending = self.uploads.pending
            pending = None if pending is None or pending.arrived else pending
            return {
                "format": "speedtronic-diloco-node/2",
                "step": self.step,
                "inner": self.inner,
                "installed": self.installed,
                "run_id": self.run_id,
                "last_round": self.last_round,
                "last_label": self.last_round,  # the key readers of this format knew first
                "anchor": codec.cpu_state_dict(self.anchor),
                "carry": None if self.carry is None else codec.cpu_state_dict(self.carry),
                "residual": None if self.residual is None else codec.cpu_state_dict(self.residual),
                "pending": None if pending is None else pending.to_dict(),
                "done": self.done,
            }

    def load_state_dict(self, state: Checkpoint) -> Contribution | None:
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
            self.anchor = codec.cpu_state_dict(state["anchor"])
            carry = state.get("carry")
            self.carry = None if carry is None else codec.cpu_state_dict(carry)
            residual = state.get("residual")  # absent in checkpoints written before int8/int4
            self.residual = None if residual is None else codec.cpu_state_dict(residual)
            self.done = bool(state.get("done", False))
        pending = state.get("pending")
        return None if pending is None else Contribution.from_dict(pending)


def _merge_into(target: torch.Tensor, anchor: torch.Tensor, value: torch.Tensor) -> None:
    """``target := value + (target - anchor)`` in place, a slice at a time (temporaries of
    one slice; a strided ``target`` at once)."""
    if not target.is_contiguous():
        update = target.to(torch.float32, copy=True).sub_(anchor.to(target.device))
        target.copy_(update.add_(value.to(target.device, torch.float32)))
        return
    flat, base, new = target.view(-1), anchor.reshape(-1), value.reshape(-1)
    for start, stop in codec.value_slices(flat.numel()):
        part = flat[start:stop]
        update = part.to(torch.float32, copy=True).sub_(base[start:stop].to(part.device))
        part.copy_(update.add_(new[start:stop].to(part.device, torch.float32)))


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Float32 CPU copies of the floating-point entries of ``model.state_dict()`` (an anchor)."""
    return {
        key: value.detach().to("cpu", torch.float32, copy=True)
        for key, value in model.state_dict().items()
        if value.is_floating_point()
    }


# -- what passes between the training thread and the exchange --------------------------
@dataclasses.dataclass
class Contribution:
    """One upload: a node's pseudo-gradient for round ``round`` (``delta`` None: only the
    ``done`` status is written, because there was nothing left to contribute)."""

    round: int
    base: int
    step: int
    delta: dict[str, torch.Tensor] | None
    final: bool = False
    run_id: str = ""
    # ``delta`` as the wire carries it (None: fp32); not checkpointed: a resumed upload
    # encodes ``delta`` again into the same codes
    wire: codec.EncodedView | None = dataclasses.field(default=None, repr=False, compare=False)
    # the exchange has it: ``delta``'s buffers may hold the node's residual now
    arrived: bool = dataclasses.field(default=False, repr=False, compare=False)

    def to_dict(self) -> dict[str, object]:
        """Checkpointable form (tensors and primitives only)."""
        return {
            "round": self.round,
            "base": self.base,
            "step": self.step,
            "delta": None if self.delta is None else codec.cpu_state_dict(self.delta),
            "final": self.final,
            "run_id": self.run_id,
        }

    @classmethod
    def from_dict(cls, data: Checkpoint) -> Contribution:
        """Rebuild a checkpointed contribution (``label``: its round, before 2.2)."""
        delta = data.get("delta")
        return cls(
            int(data["round"] if "round" in data else data["label"]),
            int(data["base"]),
            int(data["step"]),
            None if delta is None else codec.cpu_state_dict(delta),
            bool(data.get("final", False)),
            str(data.get("run_id", "")),
        )


@dataclasses.dataclass(frozen=True)
class SentMoments:
    """The first moments an upload that arrived carried: its ``round`` and the ``names`` of
    their parameters (the mean published for that round must hold exactly these)."""

    round: int
    names: frozenset[str]


@dataclasses.dataclass
class GlobalCandidate:
    """A global state waiting for the training thread (``seconds``: download time;
    ``source``: ``full`` global file, quantized outer ``update`` or ``local`` master;
    ``nbytes``: bytes downloaded, the file for an update, the weights for a full global, plus
    the first moments' file when they came with it)."""

    outer_step: int
    state: dict[str, torch.Tensor]
    seconds: float = 0.0
    final: bool = False
    run_id: str = ""
    source: str = "local"
    nbytes: int = 0
    # (round, mean first moments by parameter name) published with this global
    moments: tuple[int, dict[str, torch.Tensor]] | None = None


class GlobalInbox:
    """Where new globals arrive: offered by the in-process master, or fetched (``fetch(seen)``,
    workers) every ``interval`` seconds and sooner after :meth:`poke`, by a :class:`Loop`
    (``threaded``) or on the calling thread (:meth:`poll_due`)."""

    def __init__(
        self,
        fetch: Callable[[tuple[int, str]], GlobalCandidate | None] | None,
        *,
        interval: float,
        threaded: bool,
    ):
        self._fetch = fetch
        self.interval = interval
        self._cond = threading.Condition()
        self._candidate: GlobalCandidate | None = None
        self._seen = (-1, "")  # (outer step, run id) of the newest global offered or fetched
        self._last_poll = 0.0
        self.poller = None
        if threaded and fetch is not None:
            self.poller = Loop("speedtronic-diloco-poll", self._poll, interval)

    def offer(self, candidate: GlobalCandidate) -> None:
        """Make ``candidate`` the waiting global (the newest offer wins)."""
        with self._cond:
            self._candidate = candidate
            self._seen = (candidate.outer_step, candidate.run_id)
            self._cond.notify_all()

    def take(self) -> GlobalCandidate | None:
        """The waiting global (the slot is emptied), or None."""
        with self._cond:
            candidate, self._candidate = self._candidate, None
        return candidate

    def waiting_step(self) -> int:
        """Outer step of the waiting global (-1: none)."""
        with self._cond:
            return -1 if self._candidate is None else self._candidate.outer_step

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for an offer (inline polling happens here too)."""
        self.poll_due()
        with self._cond:
            if self._candidate is None:
                self._cond.wait(timeout)

    @property
    def fetches(self) -> bool:
        """Whether this inbox reads globals from the exchange (a worker's)."""
        return self._fetch is not None

    def forget(self) -> None:
        """Read the published global again at the next poll, even one already seen."""
        with self._cond:
            self._seen = (-1, "")

    def poke(self) -> None:
        """Ask for a poll as soon as possible (a node waits for a global)."""
        self._last_poll = 0.0
        if self.poller is not None:
            self.poller.wake()

    def poll_due(self) -> None:
        """Inline mode: poll when ``interval`` seconds passed since the last poll."""
        now = time.monotonic()
        if self.poller is None and now - self._last_poll >= self.interval:
            self._last_poll = now
            self._poll()

    def _poll(self) -> None:
        if self._fetch is None:
            return
        try:
            candidate = self._fetch(self._seen)
        except Exception as exc:
            _LOG.warning(f"global poll failed; retrying at the next poll: {exc}")
            return
        if candidate is not None:
            self.offer(candidate)

    def start(self) -> None:
        """Start the poller (threaded mode only)."""
        if self.poller is not None:
            self.poller.start()

    def stop(self, timeout: float) -> None:
        """Stop the poller (bounded join)."""
        if self.poller is not None:
            self.poller.stop(timeout)


class Uploader:
    """One upload at a time, in one slot (:attr:`pending`): on a daemon thread of its own
    that ends with the upload (``threaded``), or on the calling thread. A submit waits for
    the slot; the thread's last reference to the job goes with the thread."""

    def __init__(self, send: Callable[[Contribution], None], *, threaded: bool):
        self._send = send
        self.threaded = threaded
        self._cond = threading.Condition()
        self.pending: Contribution | None = None  # submitted, not finished

    def submit(self, job: Contribution) -> None:
        """Send ``job`` (after the previous one finished)."""
        self.drain()
        with self._cond:
            self.pending = job
        if self.threaded:
            name = "speedtronic-diloco-upload"
            threading.Thread(target=self._run, args=(job,), name=name, daemon=True).start()
        else:
            self._run(job)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no upload is in flight; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self.pending is None, timeout)

    def _run(self, job: Contribution) -> None:
        try:
            self._send(job)
        finally:
            with self._cond:
                if self.pending is job:
                    self.pending = None
                self._cond.notify_all()


# -- the node's link to the exchange ---------------------------------------------------
#: Reads of a global that met a publish between its files before the error goes up, and
#: the seconds between them (a publish writes its few files within milliseconds).
TORN_READS = 10
TORN_WAIT = 0.1


class NodeLink:
    """What one node reads from and writes to the exchange: its claim on its id (see
    :class:`NodeClaim`), its uploads (:meth:`send`), the globals (:meth:`fetch`) and the
    wait for a run's first global. Errors no retry fixes are an :class:`ExchangeAccessError`
    or ``ExchangeError`` (exit 2) naming the repository, never the token. ``max_bytes``
    bounds a global file; ``like`` is the model's state (a global must be finite in its
    dtypes); ``interrupted`` ends every wait."""

    def __init__(
        self,
        store: Store,
        settings: DistributedConfig,
        *,
        claim: NodeClaim,
        max_bytes: int,
        like: Mapping[str, torch.Tensor],
        interrupted: threading.Event,
        emit: Emit = ignore,
    ):
        self.store = store
        self.settings = settings
        self.claim = claim
        self.node_id = claim.node_id
        self.max_bytes = max_bytes
        self.like = like
        self.interrupted = interrupted
        self._emit = emit
        self.beat = time.monotonic()  # the last sign of life while waiting here
        self._displaced = ""  # the instance whose record this node took over at its claim
        # the displaced holder's round files when the watch ended, until our first upload
        self._watched: dict[str, FileInfo] | None = None
        self._holder = ""  # the displaced holder, as the log lines name it
        self._refused = ""  # checksum of a published global this node refused
        self._refused_moments: tuple[int, str] | None = None  # (outer step, run) refused
        self._told: set[str] = set()  # "node/round" refusals of our files already reported
        self.held: HeldGlobal | None = None  # the last global fetched (global_dtype int8/int4)
        self._update_bytes = 0  # size of the last update file read

    # -- errors no retry fixes ---------------------------------------------------------------
    def raise_if_permanent(self, exc: BaseException, what: str) -> None:
        """A permanent exchange error (auth refused, unusable path, invalid repo id) ends the
        node with exit code 2; an outage does not."""
        if isinstance(exc, AccessRefused):
            raise self.access_error(exc) from None
        if isinstance(exc, TransportError) and exc.kind == "permanent":
            message = f"distributed.repo_id: {what} {self.settings.repo_id!r}: {exc}"
            raise ExchangeError(scrub(message, (self.settings.token,))) from None

    def access_error(self, exc: AccessRefused) -> ExchangeAccessError:
        """Exit 2: the exchange refused this node's token; names the repository (the
        entrypoint adds where the token came from), never the token."""
        message = (
            f"distributed.repo_id: {self.settings.repo_id!r} refused this node (HTTP "
            f"{exc.status or '?'}): {exc}; check that distributed.token exists and may write "
            "this repository"
        )
        return ExchangeAccessError(
            scrub(message, (self.settings.token,)),
            repo_id=str(self.settings.repo_id),
            status=exc.status,
        )

    # -- the claim on the node id ------------------------------------------------------------
    def check_id(self) -> None:
        """Before a worker waits for a run: a live process on this host holding the id is a
        `NodeIdCollisionError` at once (nothing is written)."""
        try:
            owner = self.store.read_owner(self.node_id)
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot read from the exchange")
            return  # an outage: claim_id checks again
        if self._collides(owner):
            raise NodeIdCollisionError(self.node_id)

    def claim_id(self, **status: object) -> None:
        """Write our claim/status record (``state`` and, when done, ``final_round``); another
        live node holding the id is a `NodeIdCollisionError`, raised before any write."""
        try:
            owner = self.store.read_owner(self.node_id)
            if self._collides(owner):
                raise NodeIdCollisionError(self.node_id)
            if owner is not None and self.claim.held_elsewhere(owner):
                self._watched = self._watch_holder(owner)
            other = (owner or {}).get("instance")
            if other and other != self.claim.instance:
                self._displaced = str(other)
            if other != self.claim.instance or (owner or {}).get("state") != status["state"]:
                self.store.claim_owner(self.node_id, self.claim.record(**status))
            self.claim.claimed = True
        except NodeIdCollisionError:
            raise
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot write to the exchange")
            _LOG.warning(f"could not claim node_id {self.node_id}: {exc}")

    def _round_files(self) -> dict[str, FileInfo]:
        """This id's files on the exchange but its status record (which we write too)."""
        prefix, record = f"nodes/{self.node_id}/", f"nodes/{self.node_id}/owner.json"
        files = self.store.scan().files.items()
        return {p: i for p, i in files if p.startswith(prefix) and p != record}

    def _watch_holder(self, owner: Record) -> dict[str, FileInfo]:
        """Another host's unfinished node holds our id: watch its files for up to
        ``drop_after`` x ``round_timeout`` (a live node writes once a round). A change is a
        `NodeIdCollisionError`; none means its instance is gone and the id is taken over.
        Returns the holder's round files (checked again before our first upload)."""
        self._holder = holder = f"instance {owner.get('instance')} on host {owner.get('host', '?')}"
        window = max(self.settings.drop_after, 1) * self.settings.round_timeout
        _LOG.info(
            f"node id {self.node_id!r} is held by {holder} (state {owner.get('state')}); "
            f"watching its files for up to {window:.0f} s (distributed.drop_after x "
            "distributed.round_timeout, as long as the master waits for a silent node) before "
            "taking the id over"
        )
        before, started = self._round_files(), time.monotonic()

        def changed() -> bool:
            self.beat = time.monotonic()
            return self._round_files() != before

        pause = min(self.settings.poll_interval, 1.0)
        if wait_for(changed, timeout=window, interval=pause, stop=self.interrupted):
            self._emit("node_id_collision", node_id=self.node_id)
            waited = time.monotonic() - started
            raise NodeIdCollisionError(
                self.node_id, f"{holder} wrote to the exchange {waited:.1f} s into the watch"
            )
        _LOG.info(
            f"{holder} wrote nothing in {time.monotonic() - started:.1f} s; taking node id "
            f"{self.node_id!r} over (that instance is gone)"
        )
        return before

    def _collides(self, owner: Record | None) -> bool:
        other = self.claim.check(owner)
        if other is None:
            return False
        _LOG.error(
            f"node_id collision: another live node uses node_id {self.node_id!r} (instance "
            f"{other}); give each node a unique distributed.node_id"
        )
        self._emit("node_id_collision", node_id=self.node_id)
        return True

    def _check_still_ours(self, job: Contribution) -> None:
        """Before an upload: the record and the watched holder's files say whether another
        live node uses our id (this node stops; nothing of the other is lost)."""
        owner = self.store.read_owner(self.node_id) or {}
        later = ""
        if self._displaced and owner.get("instance") == self._displaced:
            later = f"instance {self._displaced} wrote again after this node took the id over"
        elif self._watched is not None and self._round_files() != self._watched:
            # the holder uploaded after our watch: an upload of ours could take its place
            later = (
                f"{self._holder} wrote round files after this node's watch ended; this node "
                "stops before its first upload"
            )
        if later:
            self._emit("node_id_collision", node_id=self.node_id)
            raise NodeIdCollisionError(self.node_id, later)
        if self._collides(owner):  # a later instance took our id over after our claim
            _LOG.error(
                f"node id {self.node_id!r} was taken over by instance {owner.get('instance')} "
                f"on host {owner.get('host', '?')} after this node claimed it; this node's "
                f"round {job.round} upload reclaims it and the later instance stops at its "
                "next upload (a round it uploaded first stands for this node's)"
            )

    # -- uploads -----------------------------------------------------------------------------
    def send(self, job: Contribution) -> int:
        """Upload one contribution with our status record (one commit); returns bytes."""
        with contextlib.suppress(TransportError):  # the upload below reports an outage
            self._check_still_ours(job)
        status: dict[str, object] = {"state": "training"}
        if job.final:
            status = {"state": "done", "final_round": job.round}
        try:
            if job.delta is None:  # nothing left to contribute: only the done status
                self.store.claim_owner(self.node_id, self.claim.record(**status))
                nbytes = 0
            else:
                self.store.upload_delta(
                    job.wire if job.wire is not None else job.delta,
                    node_id=self.node_id,
                    round_index=job.round,
                    local_step=job.step,
                    base_outer_step=job.base,
                    dtype=self.settings.delta_dtype,
                    block_size=self.settings.delta_block_size,
                    metadata={
                        "final": str(job.final).lower(),
                        "run_id": job.run_id,
                        "instance": self.claim.instance,
                    },
                    owner=self.claim.record(**status),
                )
                nbytes = int(self.store.last_upload_bytes)
        except AccessRefused as exc:  # the node stops at its next step (exit 2)
            raise self.access_error(exc) from None
        self.claim.claimed = True
        self._watched = None  # our files are on the exchange now: the record tells from here
        return nbytes

    # -- globals -----------------------------------------------------------------------------
    def fetch(self, seen: tuple[int, str]) -> GlobalCandidate | None:
        """The published global when its ``(outer_step, run_id)`` is not ``seen``; a refused
        one (too large, non-finite) is reported once and not downloaded again. A read that met
        a publish between its files (`TornRead`) reads again once the record changes (for at
        most ``TORN_READS`` polls); a record that does not change raises (the caller retries)."""
        started = time.perf_counter()
        metadata = self.store.global_metadata()
        deadline = time.monotonic() + TORN_READS * TORN_WAIT
        while True:
            try:
                return self._fetch(metadata, seen, started)
            except T.TornRead:
                newer = self._newer_record(metadata, deadline)
                if newer is None:
                    raise
                metadata = newer[0]

    def _newer_record(
        self, old: T.GlobalMetadata | None, deadline: float
    ) -> tuple[T.GlobalMetadata | None] | None:
        """The version record once it differs from ``old``, polled until ``deadline``."""

        def changed() -> tuple[T.GlobalMetadata | None] | None:
            record = self.store.global_metadata()
            return (record,) if record != old else None

        remaining = max(deadline - time.monotonic(), 0.0)
        return wait_for(changed, timeout=remaining, interval=TORN_WAIT, stop=self.interrupted)

    def _fetch(
        self, metadata: T.GlobalMetadata | None, seen: tuple[int, str], started: float
    ) -> GlobalCandidate | None:
        """`fetch` of the global ``metadata`` names."""
        if metadata is None or (metadata.outer_step, metadata.run_id) == seen:
            return None
        self._hear_refusals(metadata)
        if metadata.sha256 and metadata.sha256 == self._refused:
            return None
        held = self._from_update(metadata)
        if held is not None:
            return self._fetched(metadata, held.state, started, "update", held)
        try:
            metadata, state = self.store.fetch_global(metadata, max_bytes=self.max_bytes)
            # as it will be installed: a float64 1e300 is finite in the file, inf in float32
            # (keys and shapes are the node's to judge: another model ends the node, exit 2)
            bad = codec.first_non_finite(state, like=self.like)
            if bad is not None:
                raise TransportError(
                    f"{metadata.model_file} (outer step {metadata.outer_step}) holds values "
                    f"that are not finite in this model's dtype in {bad}",
                    kind="permanent",
                )
        except TransportError as exc:
            if exc.kind != "permanent":
                raise
            self._refused = metadata.sha256
            _LOG.error(f"refusing the published global: {exc}")
            self._emit("global_rejected", outer_step=metadata.outer_step, error=str(exc))
            return None
        return self._fetched(metadata, state, started, "full")

    def _hear_refusals(self, metadata: T.GlobalMetadata) -> None:
        """The record names the contributions the master refused (damaged, counted corrupt
        and pruned): this node's are said once, as an error and a ``delta_refused`` event."""
        for name in metadata.refused:
            node, _, round = name.partition("/")
            if node != self.node_id or name in self._told:
                continue
            self._told.add(name)
            _LOG.error(
                f"the master refused this node's contribution to round {round} (unreadable, "
                "damaged or unusable; counted corrupt and pruned): that round's progress is "
                "not in the global; see the master's log for why"
            )
            self._emit("delta_refused", round=int(round), outer_step=metadata.outer_step)

    def _fetched(
        self,
        metadata: T.GlobalMetadata,
        state: dict[str, torch.Tensor],
        started: float,
        how: str,
        held: HeldGlobal | None = None,
    ) -> GlobalCandidate:
        weights = sum(v.numel() * v.element_size() for v in state.values())
        nbytes = self._update_bytes if how == "update" else weights
        if self.settings.global_dtype != "fp32":  # the next update applies to this global
            self.held = held or HeldGlobal.of(metadata.outer_step, metadata.run_id, state)
        seconds = time.perf_counter() - started
        candidate = GlobalCandidate(
            metadata.outer_step, state, seconds, metadata.final, metadata.run_id, how, nbytes
        )
        found = self._moments(metadata) if self.settings.sync_inner_momentum != "off" else None
        if found is not None:
            round, moments, size = found
            candidate.moments = (round, moments)
            candidate.nbytes += size  # what this global cost to download, the moments with it
        return candidate

    def _moments(
        self, metadata: T.GlobalMetadata
    ) -> tuple[int, dict[str, torch.Tensor], int] | None:
        """The mean first moments published with global ``metadata`` names (its record's
        ``moments_round``: the round they were sent with) and their file's size, or None when
        it has none."""
        record = self.store.read_json(T.GLOBAL_STEP, default={})
        if not isinstance(record, dict) or record.get("outer_step") != metadata.outer_step:
            return None
        round = record.get("moments_round")
        which = (metadata.outer_step, metadata.run_id)
        if not isinstance(round, str) or which == self._refused_moments:
            return None
        bound = T.max_moments_bytes(self.like)
        try:
            with (
                self.store.local_copy(T.GLOBAL_MOMENTS, max_bytes=bound) as local,
                codec.open_delta(local) as reader,
            ):
                if reader.metadata.get("outer_step") != str(metadata.outer_step):
                    return None  # a later publish's: this global's were replaced
                return int(round), reader.values(), local.stat().st_size
        except TransportError as exc:
            if exc.kind != "permanent" and not isinstance(exc, RemoteNotFound):
                raise  # an outage: the next poll reads the global and its moments again
            error = str(exc)
        except ValueError as exc:
            error = f"{T.GLOBAL_MOMENTS} is unreadable: {exc}"
        self._refused_moments = which  # said once; the global itself is installed
        _LOG.error(
            f"refusing the mean first moments published with global {metadata.outer_step}: "
            f"{error}; this node keeps its own"
        )
        self._emit("moments_rejected", outer_step=metadata.outer_step, error=error)
        return None

    def _from_update(self, metadata: T.GlobalMetadata) -> HeldGlobal | None:
        """The global ``metadata`` names, as the held global + the published outer update;
        None when there is none to apply, or it is unusable (said once; the full global is
        downloaded instead). An outage raises (the next poll tries again)."""
        held = self.held
        if held is None or not metadata.update_sha256:
            return None
        if (metadata.outer_step, metadata.run_id) != (held.outer_step + 1, held.run_id):
            return None  # not the next global of this node's run: only the full one will do
        try:
            with self.store.local_copy(T.GLOBAL_UPDATE, max_bytes=self.max_bytes) as local:
                self._update_bytes = os.path.getsize(local)
                return read_update(local, held, metadata=metadata, like=self.like)
        except TransportError as exc:
            if exc.kind != "permanent" and not isinstance(exc, RemoteNotFound):
                raise
            error = str(exc)
        except ValueError as exc:
            error = str(exc)
        _LOG.warning(
            f"not applying {T.GLOBAL_UPDATE} (outer step {metadata.outer_step}): {error}; "
            "downloading the full global instead"
        )
        self._emit("global_update_refused", outer_step=metadata.outer_step, error=error)
        return None

    def first_global(self, run_id: str, resumed: bool) -> tuple[GlobalCandidate | None, str]:
        """A worker's global to start from: ``(candidate, "")``, or ``(None, why)`` when it
        has no run to take part in. A final global ends a run: a node of that run is done;
        another waits (<= ``round_timeout``) for a new run's first global. With no global, a
        fresh node waits as long for the first (None: its own weights); a resumed one not."""
        try:
            candidate = self.fetch((-1, ""))
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot read from the exchange")
            _LOG.warning(f"initial global read failed; will retry: {exc}")
            candidate = None
        timeout = self.settings.round_timeout
        if candidate is not None and candidate.final:
            old = f"outer step {candidate.outer_step}, run {candidate.run_id or '?'}"
            if run_id and candidate.run_id == run_id:
                return None, (
                    f"this node's run already ended: the exchange holds its final global "
                    f"({old}); nothing left to contribute"
                )
            _LOG.info(
                f"the exchange holds the final global of a finished run ({old}); not training "
                f"from it: waiting up to {timeout:.0f} s (distributed.round_timeout) for the "
                "first global of a new run"
            )
            candidate, waited = self._wait_for_global((candidate.outer_step, candidate.run_id))
            if candidate is None and not self.interrupted.is_set():
                return None, (
                    f"the run on the exchange already ended (final global: {old}) and no "
                    f"new run started within {waited:.1f} s of waiting; nothing to join"
                )
        elif candidate is None and not resumed:
            _LOG.info(
                f"waiting up to {timeout:.0f} s (distributed.round_timeout) for the master's "
                "first global state"
            )
            candidate, waited = self._wait_for_global((-1, ""))
            if candidate is None and not self.interrupted.is_set():
                _LOG.warning(
                    f"no global state was published within {waited:.1f} s of waiting; "
                    "training from local weights (the first global is merged when it arrives)"
                )
        return candidate, ""

    def _wait_for_global(self, seen: tuple[int, str]) -> tuple[GlobalCandidate | None, float]:
        """Poll (at most ``round_timeout``, interruptible) for a published global other than
        ``seen`` that is not final; returns it (None: none came) and the seconds waited."""
        started = time.monotonic()

        def published() -> GlobalCandidate | None:
            nonlocal seen
            self.beat = time.monotonic()
            try:
                candidate = self.fetch(seen)
            except Exception as exc:
                self.raise_if_permanent(exc, "cannot read from the exchange")
                return None
            if candidate is not None and candidate.final:
                seen, candidate = (candidate.outer_step, candidate.run_id), None
            return candidate

        pause = min(self.settings.poll_interval, 1.0)
        candidate = wait_for(
            published, timeout=self.settings.round_timeout, interval=pause, stop=self.interrupted
        )
        return candidate, time.monotonic() - started


# -- identity --------------------------------------------------------------------------
_NODE_ENV = ("SPEEDTRONIC_NODE_ID", "HOSTNAME", "HF_USERNAME", "USER")


def resolve_node_id(configured: str | None, environ: Mapping[str, str]) -> str:
    """``node_id`` -> SPEEDTRONIC_NODE_ID -> HOSTNAME -> HF_USERNAME -> USER -> ``local``,
    checked by the config layer's one node-id rule (else ``ConfigError``)."""
    candidates = [configured, *(environ.get(name) for name in _NODE_ENV), "local"]
    value = next(str(c).strip() for c in candidates if c is not None and str(c).strip())
    return check_node_id(value)


class NodeIdCollisionError(ConfigError):
    """Another live node already uses this node's id, found at the claim (before the node
    trains or writes anything) or, for the later of two nodes, when the earlier one writes
    again: exit code 2. ``detail`` says how it was found."""

    def __init__(self, node_id: str, detail: str = "") -> None:
        found = f" ({detail})" if detail else ""
        super().__init__(
            f"distributed.node_id: another live node already uses node id {node_id!r}{found}; "
            "give each worker a unique id (SPEEDTRONIC_NODE_ID, distributed.node_id, or a "
            "unique hostname)"
        )
        self.node_id = node_id


class ExchangeAccessError(ConfigError):
    """The exchange refused this node's credentials (HTTP 401/403, or 404 for its own
    repository): exit code 2. The message names the repository, never the token."""

    def __init__(self, message: str, *, repo_id: str, status: int | None = None) -> None:
        super().__init__(message)
        self.repo_id, self.status = repo_id, status

    def with_token_source(self, source: str | None) -> ExchangeAccessError:
        """The same error, naming where ``distributed.token`` came from (``env:HF_TOKEN``,
        ``secret:hf_token``, ``file``, ``cli``; None: no token was configured)."""
        where = source or "nowhere: no token is set (distributed.token, HF_TOKEN, hf_token secret)"
        return ExchangeAccessError(
            f"{self}; the token came from {where}", repo_id=self.repo_id, status=self.status
        )


class NodeClaim:
    """This process's claim on ``node_id``: the ``nodes/<id>/owner.json`` record, written at
    startup and with every upload, with the round status the master reads. Another live
    instance's token there is a collision (:class:`NodeIdCollisionError`, exit 2). A dead
    holder's claim is taken over: on this host when its pid is gone; from another host when
    its files did not change for ``drop_after`` x ``round_timeout`` (as long as the master
    waits for a silent node; :meth:`NodeLink.claim_id`), and a holder that writes after
    that stops this node before its first upload. The instance token survives restarts in
    ``<state_dir>/identity.json``."""

    def __init__(self, node_id: str, role: str, state_dir: Path, host: str | None = None):
        self.node_id, self.role = node_id, role
        self.instance = self._instance_token(state_dir / "identity.json")
        self.host = host or socket.gethostname()
        self.claimed = False
        self.reported: set[str] = set()

    @staticmethod
    def _instance_token(path: Path) -> str:
        try:
            return str(json.loads(path.read_text(encoding="utf-8"))["instance"])
        except (OSError, ValueError, KeyError, TypeError):
            token = secrets.token_hex(8)
            with contextlib.suppress(OSError):
                path.write_text(json.dumps({"instance": token}) + "\n", encoding="utf-8")
            return token

    def record(self, **status: object) -> dict[str, object]:
        """The claim record with the node's round status (``state``: ``training``, ``done``
        or ``aggregator``; ``final_round`` when done)."""
        return {
            "node_id": self.node_id,
            "instance": self.instance,
            "role": self.role,
            "host": self.host,
            "pid": os.getpid(),
            **status,  # no timestamp: an unchanged record keeps its blob id (the master skips it)
        }

    def check(self, owner: Record | None) -> str | None:
        """The instance token of a live colliding node (reported once), else None."""
        other = owner.get("instance") if owner else None
        if owner is None or not other or other == self.instance or other in self.reported:
            return None
        pid = owner.get("pid")
        # after our claim, somebody overwrote it; before it, only a running process on this
        # host is provably live
        live = self.claimed or (
            owner.get("host") == self.host
            and isinstance(pid, int)
            and pid != os.getpid()
            and _pid_alive(pid)
        )
        if not live:
            return None
        self.reported.add(str(other))
        return str(other)

    def held_elsewhere(self, owner: Record) -> bool:
        """Whether ``owner`` is another instance's record, written on another host by a node
        that has not finished: it may be live, and only its files can tell."""
        other = owner.get("instance")
        if not other or other == self.instance or owner.get("host") == self.host:
            return False
        return owner.get("state") in ("training", "aggregator")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


# -- the inner optimizer's first moment averaged across nodes (issue 33) ------------------


def _named_params(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Parameter]]:
    return ((name, p) for name, p in model.named_parameters() if p.requires_grad)


def first_moments(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The inner optimizer's first moment (AdamW ``exp_avg``) by parameter name, float32 CPU
    copies; parameters without one yet (no step taken) are absent."""
    result: dict[str, torch.Tensor] = {}
    for name, param in _named_params(model):
        moment = optimizer.state.get(param, {}).get("exp_avg")
        if isinstance(moment, torch.Tensor):
            result[name] = moment.detach().to("cpu", torch.float32, copy=True)
    return result


@torch.no_grad()
def install_first_moments(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, moments: Mapping[str, torch.Tensor]
) -> int:
    """Copy ``moments`` into the optimizer's ``exp_avg`` of the parameters of the same names
    (in their dtype and device); returns how many were installed. A parameter the optimizer
    holds no first moment for is left alone (its state starts at its first step)."""
    installed = 0
    for name, param in _named_params(model):
        moment = optimizer.state.get(param, {}).get("exp_avg")
        if name in moments and isinstance(moment, torch.Tensor):
            moment.copy_(moments[name].to(moment.device, moment.dtype))
            installed += 1
    return installed
