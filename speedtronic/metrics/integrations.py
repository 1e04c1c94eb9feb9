"""Optional metric adapters: Weights & Biases and TensorBoard (extra ``speedtronic[logging]``).

Attach with ``trainer.logger.hooks.append(TensorboardHook("runs/tb"))``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TensorboardHook", "WandbHook"]


def _step_of(payload: dict[str, Any]) -> int | None:
    step = payload.get("step")
    return int(step) if isinstance(step, int) and not isinstance(step, bool) else None


def _scalars(payload: dict[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in payload.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class WandbHook:
    """Logs every numeric payload field to a W&B run (``<event>/<key>``, at the event's step)."""

    def __init__(self, project: str | None = None, **settings: Any) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("install speedtronic[logging] to use the W&B hook") from exc
        self._wandb = wandb
        self._run = wandb.init(project=project, **settings)

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Log the event's numeric fields."""
        values = {f"{event}/{key}": value for key, value in _scalars(payload).items()}
        if values:
            self._run.log(values, step=_step_of(payload))

    def close(self) -> None:
        """Finish the W&B run."""
        self._run.finish()


class TensorboardHook:
    """Writes every numeric payload field as a scalar ``<event>/<key>`` at the event's step."""

    def __init__(self, log_dir: str = "runs") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError("install speedtronic[logging] to use the TensorBoard hook") from exc
        self.writer = SummaryWriter(log_dir=log_dir)

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Add the event's numeric fields as scalars."""
        step = _step_of(payload)
        for key, value in _scalars(payload).items():
            self.writer.add_scalar(f"{event}/{key}", value, global_step=step)

    def close(self) -> None:
        """Flush and close the writer."""
        self.writer.close()
