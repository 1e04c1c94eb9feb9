"""One run per folder (issue 29, item 1): a second run into a folder that holds another run's
checkpoints resumes it (``--resume``), starts over (``--overwrite``) or is refused with one
line and exit 2; ``keep_last`` never deletes the file just written; ``latest.json`` always
names a file that exists, SIGKILL during a save included; ``eval``/``sample``/``export`` say
which file and step they loaded.

Before: the second run started from scratch without a word, ``keep_last: 2`` deleted the step
it had just written (it kept the old run's later steps), ``latest.json`` named a missing file
and ``eval`` scored the old run's weights.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_support import run_cli, write_run_config

from speedtronic.checkpoint import CheckpointManager, read_step

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


def write_config(tmp_path: Path, steps: int = 6) -> Path:
    values = {
        "run": {"device": "cpu", "max_steps": steps, "output_dir": str(tmp_path / "run")},
        "model": MODEL,
        "data": {"num_tokens": 256, "block_size": 16, "micro_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "eval": {"holdout": 0.1, "every_steps": 0, "tokens": 256},
        "logging": {"level": "WARNING"},
    }
    return write_run_config(tmp_path, values, data={"target_batch_size": 2})


def folder_state(directory: Path) -> tuple[list[str], dict]:
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    return names, json.loads((directory / "latest.json").read_text())


def test_a_second_run_into_a_used_folder_is_refused_resumed_or_started_over(tmp_path, capsys):
    config = write_config(tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    code, _, err = run_cli(capsys, "train", "--config", str(config))
    assert code == 0, err
    before = folder_state(checkpoints)
    assert before == (
        ["latest.json", "step_000000000003.pt", "step_000000000006.pt"],
        {"step": 6, "file": "step_000000000006.pt"},
    )

    # a new run into the same folder: refused in one line, nothing changed
    code, out, err = run_cli(capsys, "train", "--config", str(config), "--max-steps", "2")
    assert code == 2 and "completed" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.directory"), err
    assert "step_000000000006.pt" in lines[0]
    assert "--resume" in lines[0] and "--overwrite" in lines[0]
    assert folder_state(checkpoints) == before

    # both flags contradict each other
    argv = ["train", "--config", str(config), "--resume", "--overwrite"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "not both" in err
    assert folder_state(checkpoints) == before

    # --resume continues that run: at step 6 it has nothing to do and writes nothing
    code, out, err = run_cli(
        capsys, "train", "--config", str(config), "--resume", "--max-steps", "2"
    )
    assert code == 0, err
    assert "completed steps=6" in out
    assert folder_state(checkpoints) == before

    # --overwrite starts a new run that owns the folder: only its own checkpoints are there
    code, out, err = run_cli(
        capsys, "train", "--config", str(config), "--overwrite", "--max-steps", "2"
    )
    assert code == 0, err
    names, pointer = folder_state(checkpoints)
    assert names == ["latest.json", "step_000000000002.pt"]
    assert pointer == {"step": 2, "file": "step_000000000002.pt"}

    # eval / sample / export use that run's newest checkpoint and say which one
    code, out, err = run_cli(capsys, "eval", "--config", str(config), "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["step"] == 2 and result["checkpoint"].endswith("step_000000000002.pt")
    code, out, err = run_cli(capsys, "sample", "--config", str(config), "--prompt", "ab")
    assert code == 0, err
    assert "step_000000000002.pt (step 2)" in err
    pytest.importorskip("transformers")
    argv = ["export", "--config", str(config), "-o", str(tmp_path / "hf")]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "step_000000000002.pt (step 2)" in out


def test_a_run_that_writes_no_checkpoints_is_not_refused_and_leaves_them(tmp_path, capsys):
    """checkpoint.enabled: false starts no series, so it cannot mix one (the in-process DiLoCo
    ideal and library users run so beside a used folder)."""
    config = write_config(tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    before = folder_state(checkpoints)
    code, _, err = run_cli(
        capsys, "train", "--config", str(config), "--set", "checkpoint.enabled=false"
    )
    assert code == 0, err
    assert folder_state(checkpoints) == before


def test_the_overwrite_setting_works_through_the_environment(tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path, steps=3)
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    monkeypatch.setenv("SPEEDTRONIC_CHECKPOINT__OVERWRITE", "true")
    code, _, err = run_cli(capsys, "train", "--config", str(config), "--max-steps", "1")
    assert code == 0, err
    names, pointer = folder_state(tmp_path / "run" / "checkpoints")
    assert names == ["latest.json", "step_000000000001.pt"] and pointer["step"] == 1


def test_keep_last_never_deletes_the_file_it_just_wrote(tmp_path):
    """A run resumed from step 100 although step 200 exists (200 was unreadable then): its
    save at 120 is the newest of the series; 200 is a branch it left and goes."""
    warnings: list[str] = []
    manager = CheckpointManager(tmp_path, every_steps=10, keep_last=2, warn=warnings.append)
    for step in (100, 200):
        manager.save(step, {"step": step})
    path = manager.save(120, {"step": 120})
    names, pointer = folder_state(tmp_path)
    assert path.exists() and pointer == {"step": 120, "file": path.name}
    assert names == ["latest.json", "step_000000000100.pt", "step_000000000120.pt"]
    assert any("step_000000000200.pt" in w for w in warnings), warnings
    manager = CheckpointManager(tmp_path, keep_last=1)
    path = manager.save(130, {"step": 130})
    assert folder_state(tmp_path) == (["latest.json", path.name], {"step": 130, "file": path.name})


_SAVER = """
import sys, torch
from speedtronic.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1], keep_last=1)
start = int(sys.argv[2])
print("ready", flush=True)
for step in range(start, start + 100000):
    manager.save(step, {"step": step, "weights": torch.full((64, 1024), float(step))})
"""


def test_latest_json_names_a_file_that_exists_under_sigkill_during_saves(tmp_path):
    """A process saving in a loop (``keep_last: 1``, the tightest pruning) is SIGKILLed at
    random moments, 12 times; after each kill the pointer names a file that exists and
    holds the step it says, and the next process goes on from there."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rng = random.Random(7)
    start = 1
    for _ in range(12):
        proc = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path), str(start)],
            env=env,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        pointer = json.loads((tmp_path / "latest.json").read_text())
        named = tmp_path / pointer["file"]
        assert named.is_file(), (pointer, sorted(p.name for p in tmp_path.iterdir()))
        assert read_step(named) == pointer["step"]
        state = CheckpointManager(tmp_path).load_latest()
        assert state["step"] >= pointer["step"]
        assert torch.equal(state["weights"], torch.full((64, 1024), float(state["step"])))
        start = state["step"] + 1
