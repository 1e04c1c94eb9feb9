"""Checkpoint files: naming, pointer, pruning, safe loading, fallback, kill during a write."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from speedtronic.checkpoint import (
    CheckpointError,
    CheckpointManager,
    atomic_json_dump,
    atomic_torch_save,
    capture_rng_state,
    restore_rng_state,
)

REPO = Path(__file__).resolve().parents[1]


def state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((3,), float(step))}}


def test_naming_pointer_and_keep_last(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=2, keep_last=2)
    assert manager.path_for(4).name == "step_000000000004.pt"
    assert [s for s in range(7) if manager.should_save(s)] == [2, 4, 6]
    for step in (2, 4, 6):
        manager.save(step, state(step))
    assert [s for s, _ in manager.step_files()] == [4, 6]
    pointer = json.loads((tmp_path / "latest.json").read_text())
    assert pointer == {"step": 6, "file": "step_000000000006.pt"}
    assert manager.load_latest()["step"] == 6


def test_keep_all_and_validation(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)
    for step in range(1, 6):
        manager.save(step, state(step))
    assert len(manager.step_files()) == 5
    with pytest.raises(ValueError, match="every_steps must be positive"):
        CheckpointManager(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_empty_directory_loads_none(tmp_path):
    assert CheckpointManager(tmp_path / "missing").load_latest() is None


class Evil:
    """Any non-allow-listed class stands in for a malicious pickle payload."""


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "step_000000000001.pt"
    torch.save({"step": 1, "obj": Evil()}, path)
    with pytest.raises(CheckpointError, match="unreadable"):
        CheckpointManager.load(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_newest_falls_back_with_warning(tmp_path, damage):
    warnings: list[str] = []
    manager = CheckpointManager(tmp_path, keep_last=None, warn=warnings.append)
    manager.save(1, state(1))
    newest = manager.save(2, state(2))
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        newest.write_bytes(b"not a checkpoint" * 10)
    else:
        newest.write_bytes(b"")
    loaded = manager.load_latest()
    assert loaded["step"] == 1
    assert len(warnings) == 1 and "step_000000000002.pt" in warnings[0]
    assert "falling back to step_000000000001.pt" in warnings[0]


def test_all_corrupt_is_an_error(tmp_path):
    manager = CheckpointManager(tmp_path, warn=lambda _m: None)
    manager.save(1, state(1)).write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        manager.load_latest()


def test_pointer_outside_directory_is_ignored(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(3, state(3))
    (tmp_path / "latest.json").write_text(json.dumps({"step": 9, "file": "../evil.pt"}))
    assert manager.load_latest()["step"] == 3


def test_atomic_helpers_leave_no_temp_files(tmp_path):
    atomic_torch_save({"a": torch.ones(2)}, tmp_path / "x.pt")
    atomic_json_dump({"b": 1}, tmp_path / "sub" / "y.json")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sub", "x.pt", "y.json"]


def test_rng_round_trip_survives_weights_only(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    captured = capture_rng_state()
    atomic_torch_save({"rng": captured}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    import speedtronic.checkpoint as ck

    manager = ck.CheckpointManager(sys.argv[1], keep_last=2)
    manager.save(1, {"step": 1, "model": {"w": torch.ones(4)}})

    real_save = torch.save

    def slow_save(obj, handle):
        # write a real prefix of the checkpoint, then hang until SIGKILL arrives
        import io
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        handle.write(data[: len(data) // 2])
        handle.flush()
        print("WRITING", flush=True)
        time.sleep(60)

    ck.torch.save = slow_save
    manager.save(2, {"step": 2, "model": {"w": torch.zeros(100_000)}})
    """
)


def test_sigkill_during_checkpoint_write_keeps_previous_loadable(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout.readline().strip() == b"WRITING"
        temps = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        assert temps and temps[0].stat().st_size > 0  # the half-written file exists
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    manager = CheckpointManager(tmp_path)
    loaded = manager.load_latest()
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["w"], torch.ones(4))
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 1
    manager.save(3, state(3))  # the next save cleans the dead writer's temp file
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
