"""``speedtronic plot``: loss, eval and learning-rate curves from a run's JSONL event log.

Reads ``train_step`` records (``{"event": "train_step", "step", "loss", "lr", ...}``) and
``eval`` records (``{"event": "eval", "step", "loss", "scope", ...}``) from a JSONL file, or from
the newest ``*.jsonl`` under a run directory.

One file can hold several runs (a run started again with the same output directory appends to
its log). Every record carries the ``run_id`` of the process that wrote it; records of logs
written before run ids existed are split at each ``train_start``. By default the **last run** is
drawn: if it resumed from a checkpoint (its ``train_start`` has ``start_step > 0``), the run it
continues (the latest earlier run that reached that step, and so on back) supplies the steps
before it, so a crash-and-resume is one curve, while a run that started from step 0 is never
mixed with an earlier one. ``each_run=True`` draws every run as its own series instead. Within
the drawn curve a step logged twice keeps its last record. Eval points are drawn on the loss
axes at their ``step``: ``local`` (a node's own weights) and ``global`` (the DiLoCo global) as
distinct series. Needs matplotlib (extra ``speedtronic[plot]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from speedtronic.json_types import JSON

__all__ = [
    "Run",
    "find_event_log",
    "last_run",
    "plot_command",
    "read_eval_points",
    "read_runs",
    "read_train_steps",
]

# scope -> (label, colour, marker) of its eval points
_EVAL_STYLE = {
    "local": ("eval (local weights)", "tab:green", "o"),
    "global": ("eval (DiLoCo global)", "tab:red", "s"),
}


@dataclass
class Run:
    """The records of one run in an event log, in file order.

    ``start_step`` is the step the run started from (``train_start.start_step``; 0 for a fresh
    run, the checkpoint's step for a resumed one).
    """

    run_id: str
    start_step: int = 0
    train_steps: list[JSON] = field(default_factory=list)
    evals: list[JSON] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Whether the run logged neither a ``train_step`` nor an ``eval`` record."""
        return not self.train_steps and not self.evals


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


def _records(path: str | Path) -> list[JSON]:
    """Every JSON object of a JSONL file, in file order (a torn last line is skipped)."""
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
            if isinstance(record, dict):
                found.append(record)
    return found


def read_runs(path: str | Path) -> list[Run]:
    """The runs of an event log in the order they first appear.

    Records are grouped by ``run_id``; records without one (logs of older versions) start a
    new run at each ``train_start``.
    """
    runs: dict[str, Run] = {}
    legacy: Run | None = None  # the current run of records without a run id
    legacy_started = False
    current: Run
    for record in _records(path):
        event = record.get("event")
        run_id = record.get("run_id")
        if run_id is None:
            if legacy is None or (event == "train_start" and legacy_started):
                legacy = Run(f"#{sum(1 for key in runs if key.startswith('#')) + 1}")
                runs[legacy.run_id] = legacy
                legacy_started = False
            legacy_started = legacy_started or event == "train_start"
            current = legacy
        else:
            current = runs.setdefault(str(run_id), Run(str(run_id)))
        if event == "train_start":
            start = record.get("start_step", 0)
            current.start_step = int(start) if isinstance(start, (int, float)) else 0
        elif event in ("train_step", "eval") and "step" in record:
            (current.train_steps if event == "train_step" else current.evals).append(record)
    return [run for run in runs.values() if not run.empty]


def _reached(run: Run) -> int:
    """The highest step ``run`` logged (train or eval), or its start step."""
    steps = [int(r["step"]) for r in (*run.train_steps, *run.evals)]
    return max([run.start_step, *steps])


def last_run(runs: list[Run]) -> list[Run]:
    """The last run and, when it resumed, the runs it continues (oldest first).

    A run that started from step ``s > 0`` continues the latest earlier run that reached step
    ``s`` (the one whose checkpoint it most likely loaded); none reached it: nothing is joined.
    """
    if not runs:
        return []
    chain = [runs[-1]]
    index = len(runs) - 1
    while chain[0].start_step > 0:
        earlier = [i for i in range(index) if _reached(runs[i]) >= chain[0].start_step]
        if not earlier:
            break
        index = earlier[-1]
        chain.insert(0, runs[index])
    return chain


def _merge(chain: list[Run], kind: str) -> list[JSON]:
    """``kind`` records of a resume chain: each run's records up to where the next one
    started from, the later run winning a step logged twice."""
    merged: list[JSON] = []
    for position, run in enumerate(chain):
        limit = chain[position + 1].start_step if position + 1 < len(chain) else None
        merged += [r for r in getattr(run, kind) if limit is None or int(r["step"]) <= int(limit)]
    return merged


def _train_steps(records: list[JSON]) -> list[JSON]:
    by_step = {int(record["step"]): record for record in records}
    return [by_step[step] for step in sorted(by_step)]


def _eval_points(records: list[JSON]) -> dict[str, list[tuple[int, float]]]:
    by_scope: dict[str, dict[int, float]] = {}
    for record in records:
        loss = record.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            scope = str(record.get("scope") or "local")
            by_scope.setdefault(scope, {})[int(record["step"])] = float(loss)
    return {scope: sorted(points.items()) for scope, points in sorted(by_scope.items())}


def read_train_steps(path: str | Path) -> list[JSON]:
    """``train_step`` records of the log's last run (with the runs it resumed), ordered by
    step; the last record per step wins."""
    return _train_steps(_merge(last_run(read_runs(path)), "train_steps"))


def read_eval_points(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{scope: [(step, loss), ...]}`` from the last run's ``eval`` records, ordered by step.

    The scope defaults to ``local``; the last record per ``(scope, step)`` wins.
    """
    return _eval_points(_merge(last_run(read_runs(path)), "evals"))


def plot_command(source: str, output: str, *, each_run: bool = False) -> str:
    """Draw loss and eval points (top) and learning rate (bottom) against step into ``output``;
    returns its path.

    ``each_run=False`` draws the log's last run (with the runs it resumed from);
    ``each_run=True`` draws every run of the log as its own series, labelled by run id.
    Raises ``FileNotFoundError`` without a log, ``ValueError`` when the log has neither
    ``train_step`` nor ``eval`` records, ``RuntimeError`` when matplotlib is not installed.
    """
    log = find_event_log(source)
    runs = read_runs(log)
    if not runs:
        raise ValueError(f"{log} contains no train_step or eval records")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(
            "speedtronic plot needs matplotlib: pip install 'speedtronic[plot]'"
        ) from exc
    if each_run:
        series = [(run.run_id, [run]) for run in runs]
    else:
        series = [(runs[-1].run_id, last_run(runs))]
    figure = Figure(figsize=(8, 6), tight_layout=True)
    FigureCanvasAgg(figure)
    loss_axes, lr_axes = figure.subplots(2, 1, sharex=True)
    steps_seen: list[int] = []
    train_count = eval_count = 0
    for number, (run_id, chain) in enumerate(series):
        records = _train_steps(_merge(chain, "train_steps"))
        evals = _eval_points(_merge(chain, "evals"))
        steps = [int(r["step"]) for r in records]
        steps_seen += steps + [step for points in evals.values() for step, _ in points]
        train_count += len(records)
        eval_count += sum(map(len, evals.values()))
        prefix = f"{run_id}: " if each_run else ""
        colour = f"C{number % 10}" if each_run else "tab:blue"
        if records:
            loss_axes.plot(
                steps, [r.get("loss") for r in records], color=colour, label=f"{prefix}train"
            )
            lr_axes.plot(
                steps, [r.get("lr") for r in records], color=colour if each_run else "tab:orange"
            )
        for scope, points in evals.items():
            label, eval_colour, marker = _EVAL_STYLE.get(
                scope, (f"eval ({scope})", "tab:purple", "^")
            )
            xs, ys = zip(*points, strict=True)
            loss_axes.plot(
                xs,
                ys,
                color=colour if each_run else eval_colour,
                marker=marker,
                linestyle="--",
                label=f"{prefix}{label}",
            )
    if each_run or any(run.evals for _, chain in series for run in chain):
        loss_axes.legend(fontsize="small")
    loss_axes.set_ylabel("loss")
    counts = f"{train_count} train_step, {eval_count} eval records, to step {max(steps_seen)}"
    if each_run:
        title = f"{log.name}: {len(runs)} runs\n{counts}"
    else:
        chain = series[0][1]
        resumed = f" (resumed at step {chain[-1].start_step})" if len(chain) > 1 else ""
        others = len(runs) - len(chain)
        earlier = f"; {others} other run(s) not drawn (--each-run)" if others else ""
        title = f"{log.name}: run {series[0][0]}{resumed}\n{counts}{earlier}"
    loss_axes.set_title(title, fontsize="medium")
    loss_axes.grid(alpha=0.3)
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("step")
    lr_axes.grid(alpha=0.3)
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target)
    return str(target)
