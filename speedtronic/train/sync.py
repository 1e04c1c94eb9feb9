"""What the trainer keeps in step with: the DiLoCo coordinator and the node's other ranks.

``NodeSyncMixin`` holds the ``Trainer``'s side of both: the coordinator's life cycle (hooked on
the inner optimizer at ``fit`` start, ``finish`` at the run's target, ``stop`` always) and
``_agree``, which after every update makes it the node's update when the node trains on
several ranks (:mod:`speedtronic.train.parallel`; one process: the local values, unchanged).
"""

from __future__ import annotations

from typing import Any

from speedtronic.train.result import SyncCoordinator

__all__ = ["NodeSyncMixin"]


class NodeSyncMixin:
    """The coordinator and rank agreement of the ``Trainer`` (see the module docstring)."""

    model: Any
    optimizer: Any
    config: Any
    coordinator: SyncCoordinator | None
    parallel: Any
    step: int
    _stop_reason: str | None
    _stop_request: str | None
    _global_seen: Any
    _coordinator_started: bool
    request_stop: Any

    def _agree(self, update: Any) -> None:
        """Make ``update`` the node's (mean loss, summed samples and tokens; one ``all_reduce``
        on several ranks), stop with every rank when one was asked to, and take rank 0's
        weights when its coordinator installed a new global. One process: local values.

        FSDP with DiLoCo (``parallel.mirrored``): rank 0's round runs here, on a full copy of
        the weights that the ranks gather only when the round reads them, and shard back only
        when a global was merged."""
        mirrored = self.parallel.mirrored
        running = self.coordinator is not None and self._coordinator_started
        wants = mirrored and running and not update.skipped and self.coordinator.wants_weights()
        seen = self.coordinator.last_global_step if self.coordinator is not None else None
        agreed = self.parallel.agree(
            update.loss,
            update.samples,
            update.tokens,
            stop=self._stop_request is not None,
            new_global=not mirrored and seen != self._global_seen,
            wants_weights=wants,
        )
        self._global_seen = seen
        update.loss, update.samples, update.tokens = agreed.loss, agreed.samples, agreed.tokens
        if agreed.stop and self._stop_reason is None:
            self._stop_reason = self._stop_request or "stop requested on another rank"
        new_global = agreed.new_global
        if mirrored and not update.skipped:
            if agreed.wants_weights:
                self.parallel.refresh_mirror(self.model)
            merged = running and self.coordinator.round_step(weights_current=agreed.wants_weights)
            new_global = agreed.wants_weights and self.parallel.any_rank(merged)
        if new_global:
            self.parallel.broadcast_model(self.model)
            if self.coordinator is None and self.config.distributed.reset_inner_optimizer:
                reset = getattr(self.optimizer, "reset_state", None)  # as rank 0's node did
                reset() if callable(reset) else self.optimizer.state.clear()

    def _start_coordinator(self) -> None:
        """Hook the coordinator on the optimizer (``attach``) and start it at this step."""
        if self.coordinator is None or self._coordinator_started:
            return
        # FSDP: the round runs in _agree, on rank 0's full copy (no hook on the optimizer)
        self.coordinator.attach(self.optimizer, hook=not self.parallel.mirrored)
        self.coordinator.start(self.step)
        self._coordinator_started = True

    def _stop_if_run_ended(self) -> None:
        """The exchange's run ended without this node (it arrived after the final global, or
        was dropped): stop with the coordinator's reason, like a stop request."""
        if self.coordinator is None or not self._coordinator_started:
            return
        if self.coordinator.run_ended and self._stop_request is None:
            self.request_stop(self.coordinator.run_ended)

    def _finish_coordinator(self) -> None:
        """The target was reached: let the coordinator run its end of run (DiLoCo: the last
        contribution, then the global that includes it is installed)."""
        if self.coordinator is not None:
            self.coordinator.finish()

    def _stop_coordinator(self) -> None:
        if self.coordinator is not None:
            try:
                self.coordinator.stop()
            finally:
                self._coordinator_started = False
