"""Chaos (issue 39, item 3): two ``speedtronic train`` processes started together on one output
folder. Before, both passed the one-run check, deleted each other's checkpoints (the loser
died late with ``could not write checkpoint ...: No such file or directory``) and mixed two
run ids in ``events.jsonl``. Now the first to lock the folder (`speedtronic.folder_lock`)
trains and the other exits 2 at once naming it; a lock file left by a dead process is taken
over. Two real processes (about 5 s on two cores): flock's behaviour between processes is
what is tested.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from process_support import reap, wait_for

from speedtronic.folder_lock import LOCK_FILE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path) -> Path:
    values = {
        "run": {"device": "cpu", "max_steps": 10**6, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"num_tokens": 256, "micro_batch_size": 2, "target_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "checkpoint": {"every_steps": 50, "keep_last": 2},
        "logging": {"level": "WARNING", "json_file": "events.jsonl"},
        "runtime": {"threads": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_two_trains_started_together_on_one_folder(tmp_path):
    """Two real processes on one folder (a lock file of a dead process already there): one
    trains, the other exits 2 at once naming it; the event log holds one run."""
    config = write_config(tmp_path)  # trains until the test stops it
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": 999999999, "host": "gone"}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPEEDTRONIC_SECRETS_DIR": str(tmp_path)}
    env.pop("SPEEDTRONIC_CONFIG", None)
    argv = [sys.executable, "-m", "speedtronic", "train", "--config", str(config)]
    running: list[subprocess.Popen] = []
    try:
        for _ in range(2):
            running.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        started = time.monotonic()
        wait_for(lambda: any(p.poll() is not None for p in running), 120, "one process to end")
        loser = next(p for p in running if p.poll() is not None)
        winner = next(p for p in running if p is not loser)
        assert winner.poll() is None, "both ended"
        lost_after = time.monotonic() - started
        err = loser.stderr.read()
        assert loser.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "is in use by another speedtronic process" in lines[0], err
        assert f"pid {winner.pid} on host {socket.gethostname()}" in lines[0]
        assert "speedtronic train since" in lines[0]
        wait_for(lambda: (out / "events.jsonl").is_file(), 120, "the winner's first event")
        winner.send_signal(signal.SIGTERM)  # graceful stop: final checkpoint, exit 0
        assert winner.wait(120) == 0, winner.stderr.read()
        assert time.monotonic() - started > lost_after
    finally:
        reap(running)
    runs = {json.loads(line)["run_id"] for line in (out / "events.jsonl").read_text().splitlines()}
    assert len(runs) == 1
    assert not (out / LOCK_FILE).exists()
