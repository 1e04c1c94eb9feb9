"""What a training run returns and the errors and seams around the loop.

``TrainResult`` is the value of ``Trainer.fit()``; ``SyncCoordinator`` is the protocol a
distributed coordinator (DumbDiLoCo) implements; ``NonFiniteLossError`` and
``GradientOverflowError`` are the loop's stop errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "MAX_CONSECUTIVE_SKIPS",
    "GradientOverflowError",
    "NonFiniteLossError",
    "SyncCoordinator",
    "TrainResult",
]

MAX_CONSECUTIVE_SKIPS = 20


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the run stopped without applying that update."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(
            f"non-finite loss ({loss}) at step {step}; training stopped and the last good "
            "checkpoint was kept (set run.stop_on_nonfinite: false to skip such updates instead)"
        )
        self.step = step
        self.loss = loss


class GradientOverflowError(RuntimeError):
    """Too many consecutive updates were skipped (gradient overflow or non-finite loss)."""


class SyncCoordinator(Protocol):
    """What the trainer calls on a distributed coordinator (DumbDiLoCo implements it).

    At the start of ``fit`` the trainer calls ``attach(optimizer)`` (the coordinator hooks its
    per-step work on ``optimizer.step``) and ``start(step)``; when the run reached its target,
    ``finish()``; always ``stop()`` at the end. ``interrupt()`` is called by ``request_stop``.
    ``load_state_dict(state)`` (a checkpoint part) may come before ``start``: the coordinator
    applies the state when it starts. Optional: ``trains`` (False: no local steps, e.g. a pure
    aggregator), ``last_heartbeat`` (liveness while the coordinator waits). A coordinator
    without ``attach`` gets ``start()`` and ``stop()`` only.
    """

    def attach(self, optimizer: Any) -> None: ...

    def start(self, step: int | None = None) -> None: ...

    def finish(self) -> None: ...

    def stop(self) -> None: ...

    def interrupt(self) -> None: ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainResult:
    """Outcome of one ``fit()``.

    ``steps``/``samples``/``tokens`` are cumulative (resumed counts included); ``final_loss`` is
    the mean micro-batch loss of the last applied update of this fit (``None`` if none ran);
    ``elapsed_s`` the wall time of this fit; ``metrics`` every ``train_step`` dict of this fit;
    ``stopped_reason`` is set when ``request_stop`` ended the run early.
    """

    steps: int
    samples: int
    tokens: int
    final_loss: float | None
    elapsed_s: float
    metrics: list[dict[str, Any]] = field(default_factory=list)
    stopped_reason: str | None = None
    skipped_updates: int = 0
