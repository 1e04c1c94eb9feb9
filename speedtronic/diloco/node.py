"""The node side of a DiLoCo round, top to bottom, hooked on the inner optimizer's step.

A node keeps an *anchor*: the float32 weights its next contribution is measured from (the
installed global, or its own weights at its last upload). After every applied optimizer step
(``Optimizer.register_step_post_hook``, as torchft's ``local_sgd.py`` does)::

    count the step
    overlapped: at the step scheduled for it (overlap_steps after the upload), wait
        (<= round_timeout) for the global of the last contribution and merge it; not before
    otherwise: merge a waiting newer global if the node already contributed for its base
    every round_steps = inner_steps / fragments steps (a boundary):
        round        = max(installed outer step, last uploaded round + 1)
        tensors      = fragment round % fragments (fragments > 1), else every one
        contribution = anchor - weights + carry + residual  of those tensors (float32, the
                       pseudo-gradient, in the old anchor's buffers)
        sent         = the contribution as the wire carries it (delta_dtype: fp32 exact;
                       bf16/fp16 cast; int8/int4 blockwise codes + scales), encoded tensor
                       by tensor as the upload's file is written
        anchor := weights (those tensors); upload (background thread when overlapped)
        upload arrived: residual = contribution - decode(sent), in the contribution's
                       buffers (error feedback; fp32: none)
        blocking: wait (<= round_timeout) for the global that includes the contribution
        overlapped: schedule its merge overlap_steps (<= round_steps) from now
    merge global G:  weights := G + (weights - anchor);  anchor := G  (in place)

The merge counts every step of progress made since the upload exactly once; an overlapped
node trains on from its own weights meanwhile (its own progress stands in for the round's
mean until the global lands, then the global replaces it). Merging at a fixed step, never
at arrival, makes every node and the ideal arithmetic
(:func:`speedtronic.testing.diloco_ideal.simulate`) merge at the same step, whatever the
link. A newer global that arrives before the node contributed for its current base is held
until the boundary: that contribution is late, and the master folds it into the open round
when it is at most ``max_staleness`` rounds old. A failed upload is carried whole (residual
included) into the next contribution of its tensors, so nothing is counted twice; the final
one (every tensor) is sent again, up to ``FINAL_UPLOAD_ATTEMPTS`` times, with a ``done``
status, and :meth:`DiLoCoNode.finish` installs the global that includes it. Network failures
are state (logged, counted, carried), never a crash of the training loop. Below the round:
its state (:class:`Rounds`, :class:`Progress`, :class:`RunEnd`) and what passes between the
training thread and the exchange; the node's link to the exchange and its identity are
:mod:`.link`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from speedtronic.background import Loop, wait_for
from speedtronic.config import ConfigError
from speedtronic.diloco import codec
from speedtronic.diloco.exchange import Emit, ExchangeError, RoundSettings, ignore
from speedtronic.retry import TransportError

__all__ = [
    "Contribution",
    "DiLoCoNode",
    "GlobalCandidate",
    "GlobalInbox",
    "MergeDue",
    "SentMoments",
    "Uploader",
    "first_moments",
    "float_state",
    "install_first_moments",
    "merge_state",
]

_LOG = logging.getLogger("speedtronic.diloco")

#: A checkpointed state: tensors, numbers, strings and nested states of them.
Checkpoint = Mapping[str, Any]
#: A node's status record on the exchange (``nodes/<id>/owner.json``), as JSON.
Record = Mapping[str, object]

# The final contribution has no next round to be carried into: finish() sends it this many
# times (each with the transport's own retries) before it gives up and says so.
FINAL_UPLOAD_ATTEMPTS = 3
#: A node says at most this often that its globals arrive after their merge step.
LATE_NOTE_SECONDS = 600.0


class DiLoCoNode:
    """The round of one node (see the module docstring): ``send`` uploads a contribution
    (raising on failure) and returns its bytes; ``inbox`` delivers new globals; ``settings``
    are the round rules, wire format and outer rule it reads."""

    def __init__(
        self,
        settings: RoundSettings,
        model: torch.nn.Module,
        *,
        send: Callable[[Contribution], int],
        inbox: GlobalInbox,
        emit: Emit = ignore,
        on_master: bool = False,
    ):
        self.settings = settings
        self.on_master = on_master  # the master's own node (its waits are for its own rounds)
        self.model = model
        self.inbox = inbox
        self._emit = emit
        self._send = send
        self.uploads = Uploader(self._upload, threaded=settings.rules.threaded_uploads)
        self._lock = threading.RLock()
        self.optimizer: torch.optim.Optimizer | None = None
        self._hook: RemovableHandle | None = None
        self.step = 0  # optimizer steps applied (absolute)
        self.inner = 0  # steps since the last contribution
        self.rounds = Rounds()  # the global installed, the rounds used up
        self._latest: GlobalCandidate | None = None  # kept for the next fragment's merge
        parts = settings.rules.fragments  # streamed: the tensors a round syncs, round by round
        self.fragments = codec.fragments_of(model.state_dict(), parts) if parts > 1 else None
        self.progress = Progress(float_state(model))  # what the next contribution is made of
        self.end = RunEnd()  # how far the end of the run got
        self.clock = RoundClock()  # where the time since the last contribution went
        self.fatal: Exception | None = None  # a permanent upload failure
        self.late_noted = -LATE_NOTE_SECONDS  # when a late global was last reported
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
        boundary is due, a scheduled merge falls due, or a waiting global may be merged): a
        sharded rank refreshes its copy only then."""
        due = self.inner + 1 >= self.settings.rules.round_steps
        merges = self.rounds.merges
        if merges:
            return due or self.step + 1 >= merges[0].step
        return due or (self.may_merge() and self.inbox.waiting_step() >= 0)

    def after_optimizer_step(self, *, weights_current: bool = True) -> bool:
        """One applied inner step; True when a global was merged into the weights.
        ``weights_current=False`` (a copy not refreshed this step) leaves a waiting global."""
        self._raise_fatal()
        self.step += 1
        self.inner += 1
        self.beat()
        self.inbox.poll_due()
        started = time.monotonic()  # a scheduled merge may wait here: the exchange's time
        merged = self._merge_now() if weights_current else False
        self.clock.waited += time.monotonic() - started
        if self.inner >= self.settings.rules.round_steps:
            merged = self._boundary(final=False) or merged
        return merged

    def _merge_now(self) -> bool:
        """Merge what is due at this step: the global of each contribution at its scheduled
        step (``sync: overlapped``: ``overlap_steps`` after the upload; held until then,
        awaited then), else a waiting newer global once the node contributed for its base.
        True when a global was merged."""
        merges = self.rounds.merges
        if not merges:
            return self.merge_waiting() if self.may_merge() else False
        merged = False
        while merges and merges[0].step <= self.step:
            merged = self._merge_scheduled(merges.pop(0)) or merged
        return merged

    def _merge_scheduled(self, due: MergeDue) -> bool:
        """A scheduled merge: once the contribution's upload is done, wait (<=
        ``round_timeout``) for a global that includes it and merge the tensors its round
        synced (a fragment's, or every one). An upload that failed is carried: the global is
        merged when the node contributed for its base (as any late global)."""
        sent = due.outer_step - 1
        pending = self.uploads.pending
        if pending is not None and pending.round == sent:
            self.uploads.drain()
        last = self.rounds.last_round
        if last is None or last < sent:  # failed: carried into a later contribution
            quiet = not self.rounds.merges and self.may_merge()
            return self.merge_waiting() if quiet else False
        keys, started = self._fragment(sent), time.monotonic()
        merged = self._await_global(due.outer_step, self.settings.rules.round_timeout, keys)
        self._note_late(due, time.monotonic() - started)
        return merged

    def _note_late(self, due: MergeDue, waited: float) -> None:
        """A global that was not there at its merge step: say so (the first time a wait
        lasts a second, then at most every ``LATE_NOTE_SECONDS``): the exchange takes longer
        than ``overlap_steps`` of training, and how to hide it."""
        now = time.monotonic()
        if waited < 1.0 or now - self.late_noted < LATE_NOTE_SECONDS:
            return
        self.late_noted = now
        _LOG.info(
            f"global {due.outer_step} arrived {waited:.1f} s after its merge step (distributed."
            f"overlap_steps {self.settings.rules.overlap_steps}): the exchange takes longer than "
            "that many steps of training; raise overlap_steps or use distributed.fragments to "
            "hide it (docs/diloco.md, 'Sizing for your link'; round_done events give the "
            "seconds)"
        )

    def _fragment(self, round_number: int) -> tuple[str, ...] | None:
        """The tensors round ``round_number`` syncs (None: every one)."""
        if self.fragments is None:
            return None
        return self.fragments[round_number % len(self.fragments)]

    def _ending(self) -> list[tuple[tuple[str, ...] | None, bool]]:
        """The rounds that end the run, each ``(its tensors, final)``: with fragments, the
        next rounds of the schedule until every fragment was synced since the last step (all
        of them, but the one a round synced at this very step, whose upload arrived: nothing
        was trained since), sent one after the other, the last one final, each folded and
        published as it comes, so the transfers of the end overlap instead of following each
        other; else one round of every tensor (None)."""
        if self.fragments is None:
            return [(None, True)]
        last = self.rounds.last_round
        synced_now = not self.inner and self.progress.carry is None and last is not None
        first, count = self.rounds.next_round(), len(self.fragments) - int(synced_now)
        return [(self._fragment(first + i), i + 1 == count) for i in range(count)]

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
        return self.rounds.may_merge()

    def _boundary(
        self, *, final: bool, ending: bool = False, keys: tuple[str, ...] | None = None
    ) -> bool:
        """Take and upload this round's contribution; wait for its global when blocking. A
        round that ends the run (``ending``: ``keys``, the last one ``final``) waits for no
        global but the final one."""
        begun = time.monotonic()
        # due by now; none in the rounds that end the run but those scheduled at this step (a
        # global that lands meanwhile would change the next ending round's bits by its timing)
        merged = self._merge_now() if not ending or self.rounds.merges else False
        if ending:  # the globals still in flight are not waited for: the ending rounds
            self.rounds.merges.clear()  # carry each tensor's progress since its last one
        previous = None if ending else self._global_before_sending()
        if previous is not None:
            merged = self._await_global(previous, self.settings.rules.round_timeout) or merged
        self.uploads.drain()
        # a round is used up only by an upload that arrived (see _upload): carried progress
        # goes out under the same round, so an outage never pushes rounds past the master's
        this_round = self.rounds.next_round()
        keys = keys if ending else self._fragment(this_round)
        with self._lock:
            delta, self.progress.anchor = self._take_contribution(keys)
            self.inner = 0
        if codec.is_all_zero(delta):
            self._emit("delta_upload_zero", step=self.step)
            if final:
                self._send_done()
            self.clock.waited += time.monotonic() - begun  # no round: its time runs on
            return merged
        syncs = self.settings.outer.syncs_moments(this_round + 1)
        if self.optimizer is not None and syncs:  # they travel with the delta, no error feedback
            moments = first_moments(self.model, self.optimizer)
            delta.update({codec.MOMENT_PREFIX + k: v for k, v in moments.items()})
        job = Contribution(
            this_round, self.rounds.base(), self.step, delta, final, self.rounds.run_id
        )
        if self.settings.wire.delta_dtype != "fp32":  # what it leaves out: the residual (_upload)
            job.wire = codec.EncodedView(
                delta, self.settings.wire.delta_dtype, self.settings.wire.block_size
            )
        self.uploads.submit(job)
        del job, delta  # the wait below holds no copy of the contribution (nor the uploader)
        if final or (self.settings.rules.sync == "blocking" and not ending):  # its global
            uploaded = self.uploads.drain() and self.progress.carry is None
            self._raise_fatal()
            if uploaded:
                timeout = self.settings.rules.round_timeout * (2 if final else 1)
                merged = self._await_global(this_round + 1, timeout) or merged
        elif not ending:  # overlapped: its global is merged overlap_steps from now
            due = MergeDue(self.step + self.settings.rules.overlap_steps, this_round + 1)
            self.rounds.merges.append(due)
        laps = self.clock.lap(begun)
        self._emit("round_done", round=this_round, step=self.step, final=final, **laps)
        return merged

    def _global_before_sending(self) -> int | None:
        """``sync: overlapped`` with at most a round in flight (``overlap_steps`` <= a round):
        the global of the previous contribution, which the node waits for (bounded) before it
        sends the next one, when it holds a global older than that (none before its first
        global: it trains from its own weights); its schedule already awaited it, so this
        wait is only the rest of one that timed out."""
        rules = self.settings.rules
        if rules.sync != "overlapped" or rules.overlap_steps > rules.round_steps:
            return None
        if self.rounds.installed is None:
            return None
        return self.rounds.awaited()

    def _take_contribution(
        self, keys: Iterable[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(anchor - weights) + carry + residual`` of ``keys`` (None: every tensor; a
        fragment's with ``fragments`` > 1) in the old anchor's buffers, and the new anchor (the
        weights, float32, for those keys), one tensor at a time: the carry and the residual of
        those keys are let go as the new anchor grows, so the node never holds a third copy of
        the model; those of other keys wait for their fragment's round."""
        state = self.model.state_dict()
        current = {key: value for key, value in state.items() if value.is_floating_point()}
        owed = self.progress
        codec.check_like(owed.anchor, current, what="the model does not match its anchor")
        carry, residual = dict(owed.carry or {}), dict(owed.residual or {})
        owed.carry = owed.residual = None  # popped below: let go tensor by tensor
        anchor = dict(owed.anchor)
        delta: dict[str, torch.Tensor] = {}
        for key in owed.anchor if keys is None else keys:
            anchor[key] = current[key].detach().to("cpu", torch.float32, copy=True)
            delta[key] = owed.anchor[key].sub_(anchor[key])
            for extra in (carry, residual):
                if key in extra:
                    delta[key].add_(extra.pop(key))
        owed.carry, owed.residual = carry or None, residual or None
        return delta, anchor

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
            with self._lock:  # a fragment's carry waits beside the other fragments'
                carry = dict(self.progress.carry or {})
                for key, value in delta.items():
                    carry[key] = value + carry[key] if key in carry else value
                self.progress.carry = carry
            _LOG.warning(
                f"delta upload for round {job.round} failed; carried to the next one: {exc}"
            )
            self._emit("delta_upload_failed", step=job.step, round=job.round, error=str(exc))
            return
        with self._lock:
            self.rounds.used(job.round)
            job.arrived = True  # a checkpoint no longer holds it (its buffers are reused)
            if isinstance(job.wire, codec.EncodedView) and self.settings.wire.error_feedback:
                # in the contribution's buffers, beside the other fragments' residuals
                kept = codec.without_moments(job.wire.keep_residual())
                self.progress.residual = {**(self.progress.residual or {}), **kept}
            names = [k[len(codec.MOMENT_PREFIX) :] for k in job.delta or () if codec.is_moment(k)]
            if names:
                self.rounds.moments_sent = SentMoments(job.round, frozenset(names))
        # the encoder's and the writer's slices
        codec.return_free_memory(beside_training=self.settings.rules.beside_training)
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
        same = candidate.outer_step == self.rounds.installed and not self._new_run(candidate)
        if same and not candidate.final:
            return False
        self.merge(candidate)
        return True

    def _merge_part(self, outer_step: int, keys: tuple[str, ...]) -> bool:
        """Merge the tensors ``keys`` (a fragment's) of the newest global once it is global
        ``outer_step`` or later: they are the same in every global until the fragment's next
        round, whose contribution this node has not sent yet (the global is kept for the
        fragments scheduled after this one). A new run's global is installed whole."""
        candidate = self.inbox.take() or self._latest
        if candidate is None:
            return False
        if self._new_run(candidate):
            self.merge(candidate)
            return True
        if candidate.outer_step < outer_step:
            self._latest = candidate
            return False
        self.merge(candidate, keys)
        return True

    def _await_global(
        self, outer_step: int, timeout: float, keys: tuple[str, ...] | None = None
    ) -> bool:
        """Wait (bounded, interruptible) until a global with outer step >= ``outer_step`` is
        merged (``keys``: only those tensors of it); newer globals met on the way are merged
        too. True when one was merged."""
        started = time.monotonic()
        deadline = started + timeout
        self.inbox.poke()
        merged = False
        rounds = self.rounds
        run = rounds.run_id

        def arrived() -> bool:  # or a new run started (its round count begins again)
            nonlocal merged
            if keys is not None:  # a fragment: merged from the newest global, once
                merged = merged or self._merge_part(outer_step, keys)
            else:
                merged = self.merge_waiting() or merged
            ready = merged if keys is not None else rounds.holds(outer_step)
            return ready or rounds.last_round is None or rounds.run_id != run

        def waited() -> bool:
            if arrived():
                return True
            self.beat()
            self.inbox.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))
            return arrived()

        wait_for(waited, timeout=timeout, interval=0.0, stop=self.interrupted)
        waited_s = time.monotonic() - started
        timed_out = not (merged if keys is not None else rounds.holds(outer_step))
        self._emit("sync_wait", outer_step=outer_step, seconds=waited_s, timed_out=timed_out)
        # a new run (reported by merge) or a stop request ends the wait without a timeout
        if timed_out and rounds.run_id == run and not self.interrupted.is_set():
            # say who waits for whom: on the master, its own node waits for its own round
            source = f"the master has not closed round {outer_step - 1} yet"
            if self.on_master:
                source = f"this master has not closed round {outer_step - 1} yet: it still "
                source += "waits for other nodes' contributions"
            _LOG.warning(
                f"this node waited {waited_s:.1f} s for global {outer_step} (bound "
                f"{timeout:.0f} s "
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
        installed, run = self.rounds.installed, self.rounds.run_id
        if installed is None:
            return False
        other = bool(candidate.run_id and run and candidate.run_id != run)
        return other or candidate.outer_step < installed

    @torch.no_grad()
    def merge(self, candidate: GlobalCandidate, keys: tuple[str, ...] | None = None) -> None:
        """``weights := G + (weights - anchor)``; ``anchor := G`` (training thread only), for
        the tensors ``keys`` (a fragment's; None: every one). A global of another run is
        installed as it is: the old run's progress, carry, residual and round numbers do not
        belong to the new one."""
        self._check_fits(candidate)
        fresh, candidate.merged = not candidate.merged, True
        self._latest = candidate if keys else None
        if self._new_run(candidate):
            keys = None
            _LOG.warning(
                f"a new run started on the exchange (global {candidate.outer_step}, run "
                f"{candidate.run_id or '?'}); restarting the round count from it",
            )
            with self._lock:
                self.rounds.last_round, self.rounds.merges, self.inner = None, [], 0
                self.progress = Progress(float_state(self.model))  # progress since is dropped
            self.rounds.installed = None
        with self._lock:
            state = candidate.state
            self._install(state if keys is None else {k: state[k] for k in keys})
            self.rounds.installed = candidate.outer_step
            self.rounds.run_id = candidate.run_id or self.rounds.run_id
            self.end.final_seen = self.end.final_seen or candidate.final
        # the download's and the slices' pages
        codec.return_free_memory(beside_training=self.settings.rules.beside_training)
        if self.settings.rules.reset_inner_optimizer and self.optimizer is not None:
            self.optimizer.state.clear()
        sent, moments = self.rounds.moments_sent, candidate.moments
        if moments is not None and sent is not None and sent.round == moments[0]:
            # the mean of the round this node sent its own to; any other round's: kept its own
            self._install_moments(candidate.outer_step, moments[0], moments[1], sent)
            self.rounds.moments_sent = None
        if not fresh:  # the tensors of another fragment, from a global already pulled
            return
        self._emit(
            "global_pulled",
            outer_step=candidate.outer_step,
            seconds=candidate.seconds,
            step=self.step,
            source=candidate.source,
            bytes=candidate.nbytes,
            final=candidate.final,
        )

    def _install_moments(
        self,
        outer_step: int,
        moments_round: int,
        moments: Mapping[str, torch.Tensor],
        sent: SentMoments,
    ) -> None:
        """Install the mean first ``moments`` of ``moments_round`` when they are the moments of
        the parameters this node sent, with their shapes, finite in their dtypes and within
        the bound of a contribution's values; otherwise refuse them (an error and a
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
                f"refusing the mean first moments of round {moments_round} published with "
                f"global {outer_step}: {exc}; this node keeps its own and trains on"
            )
            self._emit(
                "moments_rejected", outer_step=outer_step, round=moments_round, error=str(exc)
            )
            return
        install_first_moments(self.model, self.optimizer, moments)

    def _install(self, global_state: Mapping[str, torch.Tensor]) -> None:
        """:func:`merge_state` into this node's model and anchor."""
        merge_state(self.model, self.progress.anchor, global_state)

    # -- end of run -----------------------------------------------------------------------
    def finish(self) -> None:
        """The run reached its target: final contribution + ``done``; install its global."""
        if self.end.done:
            return
        self.end.finishing = True
        # fragments: every tensor trained since its own fragment's round goes in the rounds
        # that end the run (the schedule's next ones, one a fragment, no step between them)
        if self.inner > 0 or self.progress.carry is not None or self.fragments is not None:
            self.uploads.drain()  # the round taken at this step, if any: arrived or carried
            for keys, final in self._ending():
                # a failed upload at the end has no later round to be carried into: again
                for _ in range(FINAL_UPLOAD_ATTEMPTS):
                    self._boundary(final=final, ending=True, keys=keys)
                    self.uploads.drain()  # arrived, or carried: sent again under its round
                    if self.progress.carry is None or self.fatal is not None:
                        break
                if self.progress.carry is not None:
                    break
            if self.progress.carry is not None:  # not done: a resumed node's finish() sends it
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
            awaited = self.rounds.awaited()  # the global of its last contribution
            if awaited is not None:
                self._await_global(awaited, 2 * self.settings.rules.round_timeout)
            if self.settings.outer.final_average > 1 and self.inbox.fetches:
                self._await_final(2 * self.settings.rules.round_timeout)
        self.end.done = True  # nothing is left to send

    def _await_final(self, timeout: float) -> None:
        """Wait (bounded, interruptible) for the final global and install it. With
        ``final_average`` > 1 it is the mean of the last globals, published once every node
        is done, under the outer step of the last global this node holds: the inbox asks for
        it (a record that is not final yet costs no download)."""

        def installed() -> bool:
            self.merge_waiting()
            if not self.end.final_seen:
                self.beat()
                self.inbox.expect_final()
                self.inbox.poke()
                self.inbox.poll_due()
            return self.end.final_seen

        pause = min(self.settings.rules.poll_interval, 1.0)
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
            rounds = self.rounds
            last = _or_none(rounds.last_round)
            record = Contribution(last, rounds.base(), self.step, None, True, rounds.run_id)
            self.uploads.submit(record)
            self.uploads.drain()
            if record.arrived or self.fatal is not None:
                return

    def stop(self) -> bool:
        """Let an upload in flight finish (bounded); True when nothing is left pending."""
        return self.uploads.drain(self.settings.rules.upload_shutdown_timeout)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Counters, anchor, carry, the error-feedback residual and the upload in flight
        (re-sent on resume)."""
        with self._lock:
            pending = self.uploads.pending
            pending = None if pending is None or pending.arrived else pending
            merges = [[due.step, due.outer_step] for due in self.rounds.merges]
            return {
                "format": "speedtronic-diloco-node/2",
                "step": self.step,
                "inner": self.inner,
                "installed": self.rounds.base(),
                "run_id": self.rounds.run_id,
                "last_round": _or_none(self.rounds.last_round),
                "last_label": _or_none(self.rounds.last_round),  # what readers knew first
                "anchor": codec.cpu_state_dict(self.progress.anchor),
                "carry": _copy(self.progress.carry),
                "residual": _copy(self.progress.residual),
                "pending": None if pending is None else pending.to_dict(),
                "done": self.end.done,
                "merges": merges,
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
            # "none yet" is NONE (any negative), before and after it had its own name here
            installed = int(state["installed"])
            last = int(state.get("last_round", state.get("last_label", NONE)))
            self.rounds = Rounds(None if installed < 0 else installed, str(state.get("run_id", "")))
            self.rounds.last_round = None if last < 0 else last
            # absent before overlap_steps (globals were merged on arrival then)
            merges = state.get("merges") or []
            self.rounds.merges = [MergeDue(int(step), int(outer)) for step, outer in merges]
            carry, residual = state.get("carry"), state.get("residual")  # none before int8/int4
            self.progress = Progress(codec.cpu_state_dict(state["anchor"]), _copy(carry))
            self.progress.residual = _copy(residual)
            self.end.done = bool(state.get("done", False))
        pending = state.get("pending")
        return None if pending is None else Contribution.from_dict(pending)


@torch.no_grad()
def merge_state(
    model: torch.nn.Module,
    anchor: Mapping[str, torch.Tensor],
    global_state: Mapping[str, torch.Tensor],
) -> None:
    """The merge of a global: ``weights := G + (weights - anchor)``, ``anchor := G``, tensor
    by tensor and in place, for the tensors ``global_state`` holds (every one, or a
    fragment's). A tensor the model holds under several keys (tied weights) is written once,
    from its first key: all its keys hold the same values."""
    state = model.state_dict()
    written: set[tuple[object, ...]] = set()
    for key, value in global_state.items():
        target = state.get(key)
        if target is None or tuple(target.shape) != tuple(value.shape):
            continue
        base = anchor.get(key)
        identity = (target.data_ptr(), target.dtype, tuple(target.shape), target.stride())
        if identity not in written:
            written.add(identity)
            if base is None:  # not a float entry: installed as it is
                target.copy_(value.to(target.device, target.dtype))
                continue
            _merge_into(target, base, value)
        if base is not None:
            base.copy_(value)


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


#: "None yet" for a round or an outer step, as the wire and a checkpoint write it (a
#: contribution measured from the node's initial weights names base -1).
NONE = -1


def _or_none(value: int | None) -> int:
    return NONE if value is None else value


def _copy(state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if state is None else codec.cpu_state_dict(state)


@dataclasses.dataclass(frozen=True)
class MergeDue:
    """``sync: overlapped``: global ``outer_step`` (the one that includes the last
    contribution) is merged at absolute ``step``, not before, however early it arrives: so
    every node and the ideal arithmetic merge it at the same step."""

    step: int
    outer_step: int


@dataclasses.dataclass
class Rounds:
    """Where a node stands: the global it ``installed`` (None before the first) of run
    ``run_id``, the ``last_round`` an upload used up (None: none arrived yet), what its last
    upload with first moments carried (``moments_sent``) and the merges scheduled for the
    globals of its contributions, oldest first (``merges``, overlapped)."""

    installed: int | None = None
    run_id: str = ""
    last_round: int | None = None
    moments_sent: SentMoments | None = None
    merges: list[MergeDue] = dataclasses.field(default_factory=list)

    def holds(self, outer_step: int) -> bool:
        """Whether the installed global is ``outer_step`` or newer."""
        return self.installed is not None and self.installed >= outer_step

    def may_merge(self) -> bool:
        """A newer global is merged once the node contributed for its installed base."""
        return self.installed is None or _or_none(self.last_round) >= self.installed

    def awaited(self) -> int | None:
        """The global that includes the last contribution that arrived, while the node does
        not hold it (None: no contribution arrived, or its global is installed)."""
        if self.last_round is None or self.holds(self.last_round + 1):
            return None
        return self.last_round + 1

    def next_round(self) -> int:
        """The round of the next contribution: the installed global's, or the one after the
        last that arrived when later (a failed upload uses up no round)."""
        return max(self.base(), _or_none(self.last_round) + 1)

    def base(self) -> int:
        """The outer step a contribution is measured from (``NONE``: the initial weights)."""
        return _or_none(self.installed)

    def used(self, number: int) -> None:
        """An upload for round ``number`` arrived."""
        self.last_round = max(_or_none(self.last_round), number)


@dataclasses.dataclass
class Progress:
    """What the next contribution is made of besides the weights: the float32 ``anchor`` it
    is measured from, the ``carry`` of failed uploads and the ``residual`` the wire format
    left out of the last one that arrived (error feedback)."""

    anchor: dict[str, torch.Tensor]
    carry: dict[str, torch.Tensor] | None = None
    residual: dict[str, torch.Tensor] | None = None


@dataclasses.dataclass
class RoundClock:
    """Where a node's time went since its last contribution (monotonic seconds): training,
    or at a boundary (``waited``), on the exchange instead: the wait for a global or the
    upload in flight, taking and sending the contribution."""

    started: float = dataclasses.field(default_factory=time.monotonic)
    waited: float = 0.0

    def restart(self) -> None:
        """A round begins now."""
        self.started, self.waited = time.monotonic(), 0.0

    def lap(self, begun: float) -> dict[str, float]:
        """The round whose boundary began at ``begun`` ends now (the next begins): its
        ``compute_seconds``, ``wait_seconds`` and ``utilization`` (compute / both)."""
        now = time.monotonic()
        wait = self.waited + now - begun
        compute = max(0.0, now - self.started - wait)
        self.started, self.waited = now, 0.0
        return {
            "compute_seconds": compute,
            "wait_seconds": wait,
            "utilization": compute / max(compute + wait, 1e-9),
        }


@dataclasses.dataclass
class RunEnd:
    """How far the end of the run got: ``finish()`` runs (``finishing``: the final global is
    expected now), nothing is left to send (``done``), a final global was installed."""

    finishing: bool = False
    done: bool = False
    final_seen: bool = False


@dataclasses.dataclass
class GlobalCandidate:
    """A global state waiting for the training thread (``seconds``: download time;
    ``source``: ``full`` global file, quantized outer ``update``, ``local`` master, the
    node's ``own`` starting weights (the first global, built alike: nothing downloaded) or
    the ``mean`` of the held global and the last (a final global, made on the node);
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
    merged: bool = False  # its first merge reported it (a fragment's merge may come later)


class GlobalInbox:
    """Where new globals arrive: offered by the in-process master, or fetched (``fetch(seen,
    final)``, workers: a global other than ``seen``, or the final one when asked for) every
    ``interval`` seconds and sooner after :meth:`poke`, by a :class:`Loop` (``threaded``) or on
    the calling thread (:meth:`poll_due`)."""

    def __init__(
        self,
        fetch: Callable[[tuple[int, str], bool], GlobalCandidate | None] | None,
        *,
        interval: float,
        threaded: bool,
    ):
        self._fetch = fetch
        self.interval = interval
        self._cond = threading.Condition()
        self._candidate: GlobalCandidate | None = None
        self._seen = (-1, "")  # (outer step, run id) of the newest global offered or fetched
        self._final = False  # the final global is asked for, under the same outer step too
        self._last_poll = 0.0
        self.poller = None
        if threaded and fetch is not None:
            self.poller = Loop("speedtronic-diloco-poll", self._poll, interval)

    def offer(self, candidate: GlobalCandidate) -> None:
        """Make ``candidate`` the waiting global (the newest offer wins)."""
        with self._cond:
            self._candidate = candidate
            self._seen = (candidate.outer_step, candidate.run_id)
            self._final = self._final and not candidate.final
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

    def expect_final(self) -> None:
        """Fetch the final global once it is published, even under an outer step already seen."""
        with self._cond:
            self._final = True

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
            candidate = self._fetch(self._seen, self._final)
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
