"""TensorBoard gets metrics only (issue 29): no ``step`` or ``elapsed_s`` scalars, no set-up
constants; the step is the x axis and TensorBoard records wall time itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_smoke_run_writes_metrics_and_nothing_else(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--max-steps", "6"]
    args += ["--output-dir", str(tmp_path), "--set", "logging.trackers=[tensorboard]"]
    args += ["--set", "logging.run_name=tb", "--set", "eval.every_steps=3"]
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_step/loss", "train_step/lr", "train_step/tokens_per_sec", "eval/loss"} <= tags
    coordinates = {t for t in tags if t.rsplit("/", 1)[1] in {"step", "elapsed_s", "outer_step"}}
    assert coordinates == set(), coordinates
    assert not {t for t in tags if t.startswith(("train_start/", "shape_profile/"))}, tags
    assert [s.step for s in events.Scalars("train_step/loss")] == [1, 2, 3, 4, 5, 6]
    assert [s.step for s in events.Scalars("eval/loss")] == [0, 3, 6]


def test_a_diloco_event_without_a_step_is_plotted_at_its_outer_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from speedtronic.metrics.integrations import TensorboardHook

    hook = TensorboardHook(str(tmp_path))
    for outer in (1, 2):
        hook.on_event("outer_step", {"outer_step": outer, "round": outer - 1, "deltas_included": 3})
    hook.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"outer_step/deltas_included"}
    assert [s.step for s in events.Scalars("outer_step/deltas_included")] == [1, 2]
