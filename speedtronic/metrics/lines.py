"""The text form of events: one short line per event for a person to read.

The JSONL record (and ``logging.format: json``) keeps every field of an event; a text line
shows only what a user watches:

- ``train_step``: ``step=<n>/<target>``, ``loss``, ``lr``, ``tok/s``, the newest held-out loss
  (``eval=``) once an evaluation ran, and in a DiLoCo run the outer step of the global this
  node trains from (``outer_step=``) and, once it contributed, the seconds its last round
  spent training and waiting on the exchange (``train/wait=6.4/1.2s``, from the node's
  ``round_done`` event); at most `STEP_LINE_LIMIT` characters with the log prefix;
- other events: the fields `TEXT_FIELDS` names for them, in that order, or every field for an
  event it does not name (without the ``elapsed_s`` the logger adds to every record).

A field that is None is never shown, and the counters of `QUIET` (nothing went wrong:
0, False or empty) are left out.
"""

from __future__ import annotations

import math

from speedtronic.json_types import JSON

__all__ = ["QUIET", "STEP_LINE_LIMIT", "TEXT_FIELDS", "TextLines", "format_value"]

#: The longest ``train_step`` text line, ``asctime | LEVEL |`` prefix included.
STEP_LINE_LIMIT = 160

#: Per event, the fields its text line shows (in this order); the rest is in the JSONL record.
TEXT_FIELDS: dict[str, tuple[str, ...]] = {
    "train_start": (
        "start_step",
        "target_step",
        "device",
        "precision",
        "accumulation_steps",
        "ranks",
        "parameters",
    ),
    "train_end": ("steps", "loss", "elapsed_s"),
    "eval": ("scope", "outer_step", "step", "loss", "perplexity", "final"),
    "checkpoint_saved": ("step", "path", "seconds"),
    "outer_step": (
        "outer_step",
        "round",
        "reason",
        "included",
        "deltas_late",
        "deltas_stale",
        "deltas_skipped",
        "deltas_corrupt",
        "dropped",
        "round_seconds",
        "eta",
    ),
    "global_pulled": ("outer_step", "step", "source", "bytes", "seconds"),
    "sync_wait": ("outer_step", "seconds", "timed_out"),
    "delta_uploaded": ("round", "step", "bytes", "seconds", "final"),
    "round_done": ("round", "step", "compute_seconds", "wait_seconds", "utilization", "final"),
    "shape_profile": ("device_type", "precision", "alignment", "warning_count"),
}

#: Fields left out of a text line when nothing happened (0, False, empty).
QUIET = frozenset(
    {
        "deltas_late",
        "deltas_stale",
        "deltas_skipped",
        "deltas_corrupt",
        "dropped",
        "timed_out",
        "final",
        "warning_count",
        "shape_warning_count",
    }
)

_SECONDS = (
    "seconds",
    "elapsed_s",
    "round_seconds",
    "step_time_s",
    "compute_seconds",
    "wait_seconds",
)


def format_value(key: str, value: object) -> str:
    """``value`` as a text line shows it: losses with 4 decimals, durations with 3
    significant digits, other floats with 5, everything else as ``str``."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if key == "loss":
        return f"{value:.4f}"
    if key == "utilization":
        return f"{value:.3f}"
    if key in _SECONDS or key.endswith("_s"):
        return f"{value:.3g}"
    return f"{value:.5g}"


def _shown(key: str, value: object) -> bool:
    if value is None:
        return False
    return not (key in QUIET and not value)


class TextLines:
    """Renders events as text lines, remembering what a step line adds from other events:
    the target step (``train_start``), the newest held-out loss (``eval``), the outer step
    of the global this node trains from (``diloco_started``, ``global_pulled``) and the
    compute and wait seconds of its last round (``round_done``)."""

    def __init__(self) -> None:
        self.target_step: int | None = None
        self.eval_loss: float | None = None
        self.outer_step: int | None = None
        self.round_seconds: tuple[float, float] | None = None  # (compute, wait)

    def render(self, event: str, payload: JSON, *, own_elapsed: bool = False) -> str:
        """The text of ``event`` (without the log prefix). ``own_elapsed``: ``elapsed_s`` was
        given by the emitter (shown where `TEXT_FIELDS` lists it), not added by the logger."""
        self._observe(event, payload)
        if event == "train_step":
            return f"{event} {self.step_fields(payload)}"
        names = TEXT_FIELDS.get(event)
        if names is None:
            names = tuple(key for key in payload if key != "elapsed_s")
        elif not own_elapsed:
            names = tuple(key for key in names if key != "elapsed_s")
        shown = [
            f"{key}={format_value(key, payload[key])}"
            for key in names
            if key in payload and _shown(key, payload[key])
        ]
        return " ".join([event, *shown])

    def step_fields(self, payload: JSON) -> str:
        """``step=<n>/<target> loss= lr= tok/s= [eval=] [outer_step=] [train/wait=]`` of a
        ``train_step``."""
        step = payload.get("step")
        parts = []
        if step is not None:
            target = f"/{self.target_step}" if self.target_step else ""
            parts.append(f"step={step}{target}")
        loss, lr, rate = payload.get("loss"), payload.get("lr"), payload.get("tokens_per_sec")
        if isinstance(loss, (int, float)):
            parts.append(f"loss={float(loss):.4f}")
        if isinstance(lr, (int, float)):
            parts.append(f"lr={float(lr):.3g}")
        if isinstance(rate, (int, float)) and math.isfinite(rate):
            parts.append(f"tok/s={float(rate):.0f}")
        if self.eval_loss is not None:
            parts.append(f"eval={self.eval_loss:.4f}")
        if self.outer_step is not None:
            parts.append(f"outer_step={self.outer_step}")
        if self.round_seconds is not None:
            compute, wait = (_short_seconds(value) for value in self.round_seconds)
            parts.append(f"train/wait={compute}/{wait}s")
        return " ".join(parts)

    def _observe(self, event: str, payload: JSON) -> None:
        if event == "train_start" and isinstance(payload.get("target_step"), int):
            self.target_step = payload["target_step"]
        elif event == "eval" and isinstance(payload.get("loss"), (int, float)):
            self.eval_loss = float(payload["loss"])
        elif event == "diloco_started" and isinstance(payload.get("global_step"), int):
            self.outer_step = payload["global_step"]
        elif event == "global_pulled" and isinstance(payload.get("outer_step"), int):
            self.outer_step = payload["outer_step"]
        elif event == "round_done":
            compute, wait = payload.get("compute_seconds"), payload.get("wait_seconds")
            if isinstance(compute, (int, float)) and isinstance(wait, (int, float)):
                self.round_seconds = (float(compute), float(wait))


def _short_seconds(value: float) -> str:
    """Seconds in at most 3 digits below 1000 s: one decimal below 10 s, whole above."""
    return f"{value:.1f}" if value < 9.95 else f"{value:.0f}"
