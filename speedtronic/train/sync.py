"""What the trainer keeps in step with: the DiLoCo coordinator and the node's other ranks.

:class:`NodeSync` is an object the ``Trainer`` owns. It holds the coordinator seam (typed with
the :class:`~speedtronic.train.result.SyncCoordinator` Protocol: every call made on it is in
that Protocol) and the node's ranks (:class:`~speedtronic.train.parallel.SingleProcess` or a
data-parallel node). It runs the coordinator's life cycle (hooked on the inner optimizer at
``fit`` start, ``finish`` at the run's target, ``stop`` always) and :meth:`NodeSync.agree`,
which after every update makes it the node's update when the node trains on several ranks (one
process: the local values, unchanged).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from speedtronic.train.parallel import SingleProcess
from speedtronic.train.result import StepUpdate, SyncCoordinator

__all__ = ["NodeSync", "ResettableOptimizer"]


@runtime_checkable
class ResettableOptimizer(Protocol):
    """An inner optimizer with its own way to drop its state on a new global (otherwise its
    ``state`` is cleared)."""

    def reset_state(self) -> None: ...


class NodeSync:
    """The coordinator and rank agreement of one ``Trainer`` (see the module docstring).

    ``coordinator`` is ``None`` on a single node without DiLoCo (and on the ranks > 0 of a
    data-parallel node, which follow rank 0's coordinator); ``reset_inner_optimizer`` is
    ``distributed.reset_inner_optimizer``: those ranks clear their optimizer state when rank 0
    installed a new global, as rank 0's coordinator does.
    """

    def __init__(
        self,
        coordinator: SyncCoordinator | None,
        parallel: SingleProcess,
        *,
        reset_inner_optimizer: bool = False,
    ) -> None:
        self.coordinator = coordinator
        self.parallel = parallel
        self.reset_inner_optimizer = reset_inner_optimizer
        self.started = False  # the coordinator is attached and started
        self._global_seen: int | None = None  # the installed global's step at the last update

    @property
    def trains(self) -> bool:
        """False for a pure DiLoCo aggregator (no local steps, only its rounds)."""
        return self.coordinator is None or self.coordinator.trains

    def heartbeat(self, own: float) -> float:
        """The later of ``own`` and the coordinator's last sign of life (it may be waiting
        for its round)."""
        if self.coordinator is None:
            return own
        return max(own, self.coordinator.last_heartbeat)

    def interrupt(self) -> None:
        """A coordinator waiting for a global stops waiting (safe from signal handlers)."""
        if self.coordinator is not None:
            self.coordinator.interrupt()

    def start(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Hook the coordinator on ``optimizer`` (``attach``) and start it at ``step``."""
        if self.coordinator is None or self.started:
            return
        # FSDP: the round runs in agree, on rank 0's full copy (no hook on the optimizer)
        self.coordinator.attach(optimizer, hook=not self.parallel.mirrored)
        self.coordinator.start(step)
        self.started = True

    def run_ended(self) -> str | None:
        """The coordinator's reason when the exchange's run ended without this node (it
        arrived after the final global, or was dropped); ``None`` otherwise."""
        if self.coordinator is None or not self.started:
            return None
        return self.coordinator.run_ended

    def finish(self) -> None:
        """The target was reached: the coordinator runs its end of run (DiLoCo: the last
        contribution, then the global that includes it is installed)."""
        if self.coordinator is not None and self.started:
            self.coordinator.finish()

    def stop(self) -> None:
        """Stop the coordinator (always, at the end of ``fit``)."""
        if self.coordinator is not None:
            try:
                self.coordinator.stop()
            finally:
                self.started = False

    def agree(
        self,
        update: StepUpdate,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stop_asked: bool,
    ) -> bool:
        """Make ``update`` the node's (mean loss, summed samples and tokens; one ``all_reduce``
        on several ranks) and take rank 0's weights when its coordinator installed a new
        global. Returns whether some rank of the node was asked to stop (``stop_asked``: this
        one was). One process: local values.

        FSDP with DiLoCo (``parallel.mirrored``): rank 0's round runs here, on a full copy of
        the weights that the ranks gather only when the round reads them, and shard back only
        when a global was merged."""
        parallel, coordinator = self.parallel, self.coordinator
        mirrored = parallel.mirrored
        running = coordinator is not None and self.started
        wants = False
        if coordinator is not None and running and mirrored and not update.skipped:
            wants = coordinator.wants_weights()
        seen = coordinator.last_global_step if coordinator is not None else None
        agreed = parallel.agree(
            update.loss,
            update.samples,
            update.tokens,
            stop=stop_asked,
            new_global=not mirrored and seen != self._global_seen,
            wants_weights=wants,
        )
        self._global_seen = seen
        update.loss, update.samples, update.tokens = agreed.loss, agreed.samples, agreed.tokens
        new_global = agreed.new_global
        if mirrored and not update.skipped:
            if agreed.wants_weights:
                parallel.refresh_mirror(model)
            merged = False
            if coordinator is not None and running:
                merged = coordinator.round_step(weights_current=agreed.wants_weights)
            new_global = agreed.wants_weights and parallel.any_rank(merged)
        if new_global:
            parallel.broadcast_model(model)
            if coordinator is None and self.reset_inner_optimizer:
                if isinstance(optimizer, ResettableOptimizer):  # as rank 0's node did
                    optimizer.reset_state()
                else:
                    optimizer.state.clear()
        return agreed.stop
