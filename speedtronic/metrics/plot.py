"""``speedtronic plot``: loss and learning-rate curves from a run's JSONL event log.

Reads ``train_step`` records (``{"event": "train_step", "step", "loss", "lr", ...}``) and
``eval`` records (``{"event": "eval", "step", "loss", "scope", ...}``) from a JSONL file, or from
the newest ``*.jsonl`` under a run directory. A step logged twice (a resumed run re-doing steps
after a crash) keeps its last record. Eval points are drawn on the loss axes at their ``step``:
``local`` (a node's own weights) and ``global`` (the DiLoCo global) as distinct series. Needs
matplotlib (extra ``speedtronic[plot]``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["find_event_log", "plot_command", "read_eval_points", "read_train_steps"]

# scope -> (label, colour, marker) of its eval points
_EVAL_STYLE = {
    "local": ("eval (local weights)", "tab:green", "o"),
    "global": ("eval (DiLoCo global)", "tab:red", "s"),
}


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


def _records(path: str | Path, event: str) -> list[dict[str, Any]]:
    """The ``event`` records of a JSONL file that carry a step, in file order."""
    found = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed run
            if isinstance(record, dict) and record.get("event") == event and "step" in record:
                found.append(record)
    return found


def read_train_steps(path: str | Path) -> list[dict[str, Any]]:
    """``train_step`` records of a JSONL file, ordered by step (last record per step wins)."""
    by_step = {int(record["step"]): record for record in _records(path, "train_step")}
    return [by_step[step] for step in sorted(by_step)]


def read_eval_points(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{scope: [(step, loss), ...]}`` from the ``eval`` records, ordered by step.

    The scope defaults to ``local``; the last record per ``(scope, step)`` wins.
    """
    by_scope: dict[str, dict[int, float]] = {}
    for record in _records(path, "eval"):
        loss = record.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            scope = str(record.get("scope") or "local")
            by_scope.setdefault(scope, {})[int(record["step"])] = float(loss)
    return {scope: sorted(points.items()) for scope, points in sorted(by_scope.items())}


def plot_command(source: str, output: str) -> str:
    """Draw loss and eval points (top) and learning rate (bottom) against step into ``output``;
    returns its path.

    Raises ``FileNotFoundError`` without a log, ``ValueError`` when the log has neither
    ``train_step`` nor ``eval`` records, ``RuntimeError`` when matplotlib is not installed.
    """
    log = find_event_log(source)
    records = read_train_steps(log)
    evals = read_eval_points(log)
    if not records and not evals:
        raise ValueError(f"{log} contains no train_step or eval records")
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
    loss_axes.plot(steps, [r.get("loss") for r in records], color="tab:blue", label="train")
    for scope, points in evals.items():
        label, colour, marker = _EVAL_STYLE.get(scope, (f"eval ({scope})", "tab:purple", "^"))
        xs, ys = zip(*points, strict=True)
        loss_axes.plot(xs, ys, color=colour, marker=marker, linestyle="--", label=label)
    if evals:
        loss_axes.legend()
    loss_axes.set_ylabel("loss")
    last = max([*steps, *(step for points in evals.values() for step, _ in points)])
    counts = f"{len(records)} train_step, {sum(map(len, evals.values()))} eval records"
    loss_axes.set_title(f"{log.name}: {counts}, to step {last}")
    loss_axes.grid(alpha=0.3)
    lr_axes.plot(steps, [r.get("lr") for r in records], color="tab:orange")
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("step")
    lr_axes.grid(alpha=0.3)
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target)
    return str(target)
