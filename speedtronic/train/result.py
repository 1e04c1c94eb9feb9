"""What a training run returns and the errors and seams around the loop.

``TrainResult`` is the value of ``Trainer.fit()``; ``TrainerOptions`` holds the ``Trainer``'s
settings beyond the objects it drives (2.0.0's ``max_steps=``, ``start_step=``, ``precision=``
and ``shape_report=`` keywords still map onto it, with a ``DeprecationWarning``);
``SyncCoordinator`` is the protocol a distributed coordinator (DumbDiLoCo) implements;
``NonFiniteLossError`` and ``GradientOverflowError`` are the loop's stop errors.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

from speedtronic.json_types import JSON, StateDict

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from speedtronic.train.evaluate import HeldOut
    from speedtronic.train.parallel import SingleProcess
    from speedtronic.train.precision import PrecisionPlan
    from speedtronic.train.shapes import ShapeReport

__all__ = [
    "MAX_CONSECUTIVE_SKIPS",
    "GradientOverflowError",
    "LegacyTrainerKeywords",
    "NonFiniteLossError",
    "StartStop",
    "StartStopCoordinator",
    "StepUpdate",
    "SyncCoordinator",
    "TrainResult",
    "TrainerOptions",
    "as_sync_coordinator",
    "with_legacy_keywords",
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


@dataclass
class TrainerOptions:
    """The ``Trainer``'s settings beyond the objects it drives; each defaults to the config.

    ``accumulation_steps`` overrides ``data.accumulation_steps``; ``heldout`` (a ``HeldOut``
    from ``build_heldout``) turns on ``eval`` events (local weights); ``parallel`` (from
    ``speedtronic.train.parallel.start_parallel``) makes the trainer one rank of a
    data-parallel node (default: one process). ``max_steps`` is the absolute step target
    (default ``run.max_steps``), ``start_step`` the step counter it starts from;
    ``precision`` defaults to ``resolve_precision(config.precision, device)``; a
    ``shape_report`` says the startup shape check already ran (the trainer skips its own).
    """

    accumulation_steps: int | None = None
    heldout: HeldOut | None = None
    parallel: SingleProcess | None = None
    max_steps: int | None = None
    start_step: int = 0
    precision: PrecisionPlan | None = None
    shape_report: ShapeReport | None = None


class LegacyTrainerKeywords(TypedDict, total=False):
    """2.0.0's ``Trainer`` keywords that are :class:`TrainerOptions` fields now."""

    max_steps: int | None
    start_step: int
    precision: PrecisionPlan | None
    shape_report: ShapeReport | None


def with_legacy_keywords(options: TrainerOptions, legacy: LegacyTrainerKeywords) -> TrainerOptions:
    """``options`` with 2.0.0's ``Trainer(max_steps=..., ...)`` keywords applied, with a
    ``DeprecationWarning`` naming the new spelling; any other keyword is a ``TypeError`` as for
    any call."""
    unknown = sorted(set(legacy) - set(LegacyTrainerKeywords.__annotations__))
    if unknown:
        raise TypeError(f"Trainer() got unexpected keyword arguments: {', '.join(unknown)}")
    given = ", ".join(f"{name}=..." for name in legacy)
    warnings.warn(
        f"Trainer({given}) is deprecated; pass options=TrainerOptions({given})",
        DeprecationWarning,
        stacklevel=3,
    )
    return dataclasses.replace(options, **legacy)


@dataclass
class StepUpdate:
    """What one update of the trainer produced (the node's values after ``NodeSync.agree``)."""

    loss: float
    grad_norm: float | None
    samples: int
    tokens: int
    micro_batches: int
    skipped: str | None = None  # reason when the update was not applied


@runtime_checkable
class MembershipSource(Protocol):
    """A coordinator that knows a run's nodes (the DiLoCo coordinator): ``membership()`` is
    how many nodes the open round waits for and the seconds since each node was seen, read by
    ``/metrics`` at scrape time (None where this process is no master)."""

    def membership(self) -> tuple[int, Mapping[str, float]] | None: ...


@runtime_checkable
class SyncCoordinator(Protocol):
    """Everything the trainer (through ``train/sync.py``'s ``NodeSync``) and the entrypoint use
    of a distributed coordinator (DumbDiLoCo implements it).

    Life cycle: at the start of every ``fit`` the trainer calls ``attach(optimizer)`` (the
    coordinator hooks its per-step round on ``optimizer.step``; ``hook=False`` when the model
    it sees is a copy and the trainer calls ``round_step`` itself) and ``start(step)``; when
    the run reached its target, ``finish()``; always ``stop()`` at the end. ``interrupt()`` is
    called by ``request_stop`` (also from signal handlers). ``load_state_dict(state)`` (a
    checkpoint part) may come before ``start``: the coordinator applies it when it starts.

    Read by the trainer: ``trains`` (False: no local steps, a pure aggregator),
    ``run_ended`` (set when the exchange's run ended without this node: the trainer stops with
    it as the reason), ``last_heartbeat`` (``time.monotonic()`` of the last sign of life, also
    while waiting for a round), ``last_global_step`` (the installed global's outer step; -1:
    none), ``wants_weights()`` (the next ``round_step`` reads or writes the weights). Read by
    the entrypoint: ``node_id``, ``role`` (metric labels) and ``is_ready()`` (``/readyz``); a
    coordinator that also has ``membership()`` is a :class:`MembershipSource`.
    """

    node_id: str
    role: str
    trains: bool

    @property
    def run_ended(self) -> str | None: ...

    @property
    def last_heartbeat(self) -> float: ...

    @property
    def last_global_step(self) -> int: ...

    def is_ready(self) -> bool: ...

    def attach(self, optimizer: Optimizer, *, hook: bool = True) -> None: ...

    def wants_weights(self) -> bool: ...

    def round_step(self, *, weights_current: bool) -> bool: ...

    def start(self, step: int | None = None) -> None: ...

    def finish(self) -> None: ...

    def stop(self) -> None: ...

    def interrupt(self) -> None: ...

    def state_dict(self) -> StateDict | None: ...

    def load_state_dict(self, state: StateDict) -> None: ...


class StartStop(Protocol):
    """A 2.0.0-style coordinator: it is started and stopped and its state is checkpointed
    (``load_state_dict`` is called only on a resume that holds coordinator state)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def state_dict(self) -> StateDict | None: ...

    def load_state_dict(self, state: StateDict) -> None: ...


class StartStopCoordinator:
    """A :class:`StartStop` coordinator seen through :class:`SyncCoordinator`: it is started
    and stopped, its state is checkpointed, and nothing else is asked of it (no node id or
    role labels: those are a DiLoCo node's)."""

    node_id = ""
    role = ""
    trains = True
    run_ended: str | None = None
    last_global_step = -1

    def __init__(self, wrapped: StartStop) -> None:
        self.wrapped = wrapped
        self._beat = time.monotonic()

    @property
    def last_heartbeat(self) -> float:
        """When it was started (it has no rounds to wait for)."""
        return self._beat

    def is_ready(self) -> bool:
        """Always ready."""
        return True

    def membership(self) -> None:
        """No nodes of its own."""
        return None

    def attach(self, optimizer: Optimizer, *, hook: bool = True) -> None:
        """Nothing is hooked on the optimizer."""

    def wants_weights(self) -> bool:
        """Never: there is no round."""
        return False

    def round_step(self, *, weights_current: bool) -> bool:
        """No round: nothing is merged."""
        return False

    def start(self, step: int | None = None) -> None:
        """``start()`` of the wrapped coordinator."""
        self._beat = time.monotonic()
        self.wrapped.start()

    def finish(self) -> None:
        """No end of run."""

    def stop(self) -> None:
        """``stop()`` of the wrapped coordinator."""
        self.wrapped.stop()

    def interrupt(self) -> None:
        """Nothing waits."""

    def state_dict(self) -> StateDict | None:
        """The wrapped coordinator's state."""
        return self.wrapped.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        """Hand the checkpointed state back to the wrapped coordinator."""
        self.wrapped.load_state_dict(state)


def as_sync_coordinator(coordinator: SyncCoordinator | StartStop | None) -> SyncCoordinator | None:
    """``coordinator`` itself when it implements :class:`SyncCoordinator`; a 2.0.0-style one
    (:class:`StartStop`) wrapped in :class:`StartStopCoordinator`; None stays None."""
    if coordinator is None or isinstance(coordinator, SyncCoordinator):
        return coordinator
    return StartStopCoordinator(coordinator)


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
    metrics: list[JSON] = field(default_factory=list)
    stopped_reason: str | None = None
    skipped_updates: int = 0
