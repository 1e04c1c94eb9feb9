"""Optional metric adapters: Weights & Biases and TensorBoard (extra ``speedtronic[logging]``).

Attach with ``trainer.logger.hooks.append(TensorboardHook("runs/tb"))``.

Both get metrics only: the numeric fields of an event, less its coordinates (`COORDINATES`:
the step it happened at, the logger's elapsed time, the round it belongs to) and less the
events that describe the set-up rather than measure it (`SETUP_EVENTS`, constants such as the
parameter count). A tracker plots against the step already and records wall time itself.
"""

from __future__ import annotations

from typing import Any

from speedtronic.json_types import JSON

__all__ = ["COORDINATES", "SETUP_EVENTS", "TensorboardHook", "WandbHook", "metric_values"]

#: Fields that say where or when an event happened, never plotted as a metric.
COORDINATES = frozenset(
    {"step", "elapsed_s", "outer_step", "base_outer_step", "round", "start_step", "target_step"}
)
#: Events that describe the run's set-up (logged once, constants): no scalars.
SETUP_EVENTS = frozenset({"train_start", "shape_profile", "diloco_started", "compile", "replicas"})


def _integer(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _step_of(payload: JSON) -> int | None:
    return _integer(payload.get("step"))


def metric_values(event: str, payload: JSON) -> dict[str, float]:
    """The metrics of one event: its numeric fields, less `COORDINATES`; none for
    `SETUP_EVENTS`."""
    if event in SETUP_EVENTS:
        return {}
    return {
        key: float(value)
        for key, value in payload.items()
        if key not in COORDINATES
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }


class WandbHook:
    """Logs an event's metrics (`metric_values`) to a W&B run (``<event>/<key>``, at the
    event's step)."""

    def __init__(self, project: str | None = None, **settings: Any) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("install speedtronic[logging] to use the W&B hook") from exc
        self._wandb = wandb
        self._run = wandb.init(project=project, **settings)

    def on_event(self, event: str, payload: JSON) -> None:
        """Log the event's numeric fields."""
        values = {f"{event}/{key}": value for key, value in metric_values(event, payload).items()}
        if values:
            self._run.log(values, step=_step_of(payload))

    def close(self) -> None:
        """Finish the W&B run."""
        self._run.finish()


class TensorboardHook:
    """Writes an event's metrics (`metric_values`) as scalars ``<event>/<key>`` at the
    event's step, or for a DiLoCo event without one (``outer_step``) at its outer step."""

    def __init__(self, log_dir: str = "runs") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError("install speedtronic[logging] to use the TensorBoard hook") from exc
        self.writer = SummaryWriter(log_dir=log_dir)

    def on_event(self, event: str, payload: JSON) -> None:
        """Add the event's numeric fields as scalars."""
        step = _step_of(payload)
        if step is None:
            step = _integer(payload.get("outer_step"))
        for key, value in metric_values(event, payload).items():
            self.writer.add_scalar(f"{event}/{key}", value, global_step=step)

    def close(self) -> None:
        """Flush and close the writer."""
        self.writer.close()
