"""``speedtronic plot``: loss and learning-rate curves from a run's JSONL event log.

Reads ``train_step`` records (``{"event": "train_step", "step", "loss", "lr", ...}``) from a
JSONL file, or from the newest ``*.jsonl`` under a run directory. A step logged twice (a resumed
run re-doing steps after a crash) keeps its last record. Needs matplotlib (extra
``speedtronic[plot]``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["find_event_log", "plot_command", "read_train_steps"]


def find_event_log(source: str | Path) -> Path:
    """The JSONL file itself, or the newest ``*.jsonl`` below a directory."""
    path = Path(source)
    if path.is_file():
        return path
    if path.is_dir():
        candidates = sorted(path.rglob("*.jsonl"), key=lambda p: p.stat().st_mtime)
        if candidates:
            return candidates[-1]
        raise FileNotFoundError(f"no *.jsonl event log under {path} (set logging.json_file)")
    raise FileNotFoundError(f"plot source not found: {path}")


def read_train_steps(path: str | Path) -> list[dict[str, Any]]:
    """``train_step`` records of a JSONL file, ordered by step (last record per step wins)."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed run
            if isinstance(record, dict) and record.get("event") == "train_step":
                by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def plot_command(source: str, output: str) -> str:
    """Draw loss (top) and learning rate (bottom) against step into ``output``; returns its path.

    Raises ``FileNotFoundError`` without a log, ``ValueError`` when the log has no
    ``train_step`` records, ``RuntimeError`` when matplotlib is not installed.
    """
    log = find_event_log(source)
    records = read_train_steps(log)
    if not records:
        raise ValueError(f"{log} contains no train_step records")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(
            "speedtronic plot needs matplotlib: pip install 'speedtronic[plot]'"
        ) from exc
    steps = [r["step"] for r in records]
    figure = Figure(figsize=(8, 6), tight_layout=True)
    FigureCanvasAgg(figure)
    loss_axes, lr_axes = figure.subplots(2, 1, sharex=True)
    loss_axes.plot(steps, [r.get("loss") for r in records], color="tab:blue")
    loss_axes.set_ylabel("loss")
    loss_axes.set_title(f"{log.name}: {len(records)} steps")
    loss_axes.grid(alpha=0.3)
    lr_axes.plot(steps, [r.get("lr") for r in records], color="tab:orange")
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("step")
    lr_axes.grid(alpha=0.3)
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target)
    return str(target)
