"""Issue 39: one process per output folder; a refused run writes nothing; ``--overwrite``
deletes nothing unless it can delete everything.

Item 3: the folder lock (`speedtronic.folder_lock`) names its holder, is taken over from a
dead process, never follows a link or waits on a FIFO. Two real ``train`` processes racing
for one folder: ``tests/chaos/test_folder_race.py``; a writer SIGKILLed while it holds the
lock: the crash loop (``tests/chaos/crash_loop.py``).
Item 7: a run refused at start (another run's checkpoints, a missing data file) used to
rewrite the folder's ``resolved_config.yaml``; now nothing in the folder changes.
Item 14: ``--overwrite`` over a file that cannot be deleted, or a ``latest.json`` that is a
directory, is one line and exit 2 before anything is deleted or trained.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from speedtronic.cli import main
from speedtronic.config import ConfigError
from speedtronic.folder_lock import LOCK_FILE, FolderInUseError, FolderLock

MODEL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


def write_config(tmp_path: Path, steps: int = 4) -> Path:
    values = {
        "run": {"device": "cpu", "max_steps": steps, "output_dir": str(tmp_path / "run")},
        "model": MODEL,
        "data": {"num_tokens": 256, "micro_batch_size": 2, "target_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 3},
        "logging": {"level": "WARNING", "json_file": "events.jsonl"},
        "runtime": {"threads": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file and directory under ``folder``: its bytes (None for a directory)."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
        for path in sorted(folder.rglob("*"))
    }


@pytest.fixture
def trained(tmp_path, capsys) -> Path:
    config = write_config(tmp_path)
    code, _, err = run_cli(capsys, "train", "--config", str(config))
    assert code == 0, err
    return config


# ------------------------------------------------------------------------- item 7


def test_a_refused_run_leaves_the_folder_as_it_was(trained, tmp_path, capsys):
    out = tmp_path / "run"
    before = snapshot(out)
    assert "resolved_config.yaml" in before
    code, _, err = run_cli(capsys, "train", "--config", str(trained), "--set", "optimizer.lr=0.5")
    assert code == 2 and "holds another run's checkpoints" in err
    assert snapshot(out) == before
    # refused later at start (no such data file): --overwrite deleted nothing, wrote nothing
    missing = f"data.token_path={tmp_path / 'missing.bin'}"
    code, out_text, err = run_cli(
        capsys, "train", "--config", str(trained), "--overwrite", "--set", missing
    )
    assert code == 2 and "data.token_path" in err and "completed" not in out_text
    assert snapshot(out) == before


def test_overwrite_deletes_the_old_run_once_the_new_one_starts(trained, tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "train", "--config", str(trained), "--overwrite", "--max-steps", "1"
    )
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["latest.json", "step_000000000001.pt"]
    record = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())
    assert record["sources"]["checkpoint.overwrite"] == "cli"


# ------------------------------------------------------------------------- item 14


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_a_latest_json_that_is_a_directory_is_refused_first(trained, tmp_path, capsys, flag):
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "latest.json").unlink()
    (checkpoints / "latest.json").mkdir()
    (checkpoints / "latest.json" / "keep.txt").write_text("someone's file")
    before = snapshot(tmp_path / "run")
    code, out, err = run_cli(capsys, "train", "--config", str(trained), flag, "--max-steps", "6")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "latest.json is not a file" in lines[0] and "completed" not in out
    assert snapshot(tmp_path / "run") == before


def _pin(path: Path) -> None:
    """Make ``path`` undeletable: ``chattr +i`` (root too), else a read-only folder."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return
    if os.geteuid() == 0:
        pytest.skip("chattr +i is not available here and root deletes anything else")
    path.parent.chmod(0o555)


def _unpin(path: Path) -> None:
    subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.parent.chmod(0o755)


def test_overwrite_over_an_undeletable_file_deletes_nothing(trained, tmp_path, capsys):
    newest = tmp_path / "run" / "checkpoints" / "step_000000000004.pt"
    before = snapshot(tmp_path / "run")
    _pin(newest)
    try:
        code, out, err = run_cli(capsys, "train", "--config", str(trained), "--overwrite")
        after = snapshot(tmp_path / "run")
    finally:
        _unpin(newest)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "cannot delete" in lines[0] and "nothing was deleted" in lines[0]
    assert "completed" not in out
    assert after == before


# ------------------------------------------------------------------------- item 3


def test_the_lock_names_its_holder_and_a_dead_one_is_taken_over(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(json.dumps({"pid": 999999999, "host": "gone"}))
    lock = FolderLock.acquire(folder, command="speedtronic train")  # a leftover is not held
    record = json.loads((folder / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(FolderInUseError) as refused:
        FolderLock.acquire(folder, command="speedtronic run")
    assert f"(pid {os.getpid()} on host {socket.gethostname()}, speedtronic train since" in str(
        refused.value
    )
    assert refused.value.pid == os.getpid()
    lock.release()
    assert not (folder / LOCK_FILE).exists()
    FolderLock.acquire(folder, command="speedtronic train").release()


def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_without_waiting(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    for name, make in (("link", lambda p: p.symlink_to(target)), ("fifo", os.mkfifo)):
        folder = tmp_path / name
        folder.mkdir()
        make(folder / LOCK_FILE)
        with pytest.raises(ConfigError, match=r"run\.output_dir"):
            FolderLock.acquire(folder, command="speedtronic train")
    assert target.read_text() == "keep"
