"""``speedtronic train``: build the runtime, wire signals and a progress bar, run ``fit()``.

SIGINT/SIGTERM ask the trainer to stop at the next update boundary (final checkpoint, coordinator
stopped, normal return with ``TrainResult.stopped_reason`` set); a second signal while stopping
raises ``KeyboardInterrupt``. The previous handlers are restored afterwards. On a terminal a tqdm
bar shows progress, loss and learning rate (per-step text lines are then left to the JSONL file);
otherwise the usual log lines are written.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from speedtronic.train.result import TrainResult

__all__ = ["ProgressBarHook", "install_stop_handlers", "train_command"]


def install_stop_handlers(
    request_stop: Callable[[str], None],
    is_stopping: Callable[[], bool] = lambda: False,
    signals: Iterable[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
) -> Callable[[], None]:
    """Route ``signals`` to ``request_stop(<signal name>)``; returns a function that restores
    the previous handlers. A no-op outside the main thread (Python only delivers signals there).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[signal.Signals, Any] = {}

    def handler(signum: int, _frame: Any) -> None:
        if is_stopping():
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name} while stopping")
        request_stop(signal.Signals(signum).name)

    for sig in signals:
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


class _TqdmStream:
    """A text stream that writes through ``tqdm.write`` so log lines do not break the bar."""

    def write(self, text: str) -> int:
        from tqdm import tqdm

        if text.strip():
            tqdm.write(text.rstrip("\n"))
        return len(text)

    def flush(self) -> None:
        """Nothing to flush (tqdm writes immediately)."""


class ProgressBarHook:
    """A tqdm bar fed by ``train_step`` events (every step, regardless of log cadence)."""

    wants_all_steps = True

    def __init__(self, initial: int, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Advance the bar on ``train_step``; show loss and lr."""
        if event == "train_step":
            self.bar.update(int(payload["step"]) - self.bar.n)
            self.bar.set_postfix(loss=f"{payload['loss']:.4f}", lr=f"{payload['lr']:.3g}")
        elif event == "train_stopped":
            self.bar.set_description(f"stopping ({payload.get('reason')})")

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


def train_command(
    config: Any,
    *,
    resume: bool = False,
    progress: bool | None = None,
    extra_hooks: Iterable[Any] = (),
) -> TrainResult:
    """Train ``config`` (a ``SpeedtronicConfig``) as ``speedtronic train`` does.

    ``progress=None`` shows a progress bar only when stdout is a terminal. ``extra_hooks`` are
    appended to the logger's hooks. Raises ``ConfigError`` for bad settings (before training)
    and the trainer's errors otherwise; the CLI maps them to exit codes.
    """
    from speedtronic.train.runtime import build_runtime

    trainer, _ = build_runtime(config, resume=resume)
    logger = trainer.logger
    logger.hooks.extend(extra_hooks)
    show = _isatty(sys.stdout) if progress is None else bool(progress)
    bar: ProgressBarHook | None = None
    if show:
        bar = ProgressBarHook(trainer.step, max(trainer.step, trainer.max_steps))
        logger.hooks.append(bar)
        if logger.file is None:  # the bar replaces per-step lines on the terminal only
            logger.text_steps = False
            logger.set_stream(_TqdmStream())
    restore = install_stop_handlers(
        trainer.request_stop, is_stopping=lambda: trainer.stop_requested is not None
    )
    try:
        return trainer.fit()
    finally:
        restore()
        if bar is not None:
            bar.close()
        logger.close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
