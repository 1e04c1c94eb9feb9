"""A terminal progress bar for ``speedtronic train``: a hook fed by ``train_step`` events.

While the bar is shown, the MetricLogger's text lines go through `TqdmStream` so they do not
break it, and per-step lines are left to the JSONL file.
"""

from __future__ import annotations

from speedtronic.json_types import JSON

__all__ = ["ProgressBarHook", "TqdmStream"]


class TqdmStream:
    """A text stream that writes through ``tqdm.write`` so log lines do not break the bar."""

    def write(self, text: str) -> int:
        """Write ``text`` above the bar; returns the number of characters taken."""
        from tqdm import tqdm

        if text.strip():
            tqdm.write(text.rstrip("\n"))
        return len(text)

    def flush(self) -> None:
        """Nothing to flush (tqdm writes immediately)."""


class ProgressBarHook:
    """A tqdm bar (on stderr) from step ``initial`` to ``total``, fed by ``train_step``
    events (every step, regardless of the logger's cadence)."""

    wants_all_steps = True

    def __init__(self, initial: int, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def on_event(self, event: str, payload: JSON) -> None:
        """Advance the bar on ``train_step``; show loss and lr."""
        if event == "train_step":
            self.bar.update(int(payload["step"]) - self.bar.n)
            self.bar.set_postfix(loss=f"{payload['loss']:.4f}", lr=f"{payload['lr']:.3g}")
        elif event == "train_stopped":
            self.bar.set_description(f"stopping ({payload.get('reason')})")

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()
