"""Which checkpoint a resume uses (issue 12 row 13).

The newest checkpoint is the one whose *recorded* step is highest, not the one with the
highest file name; unreadable and incompatible files (another model shape, a bad step, other
optimizer groups) are skipped with a warning each and the run resumes from the newest usable
one; only when none is usable is it an error.
"""

from __future__ import annotations

import torch

from speedtronic.checkpoint import CheckpointError, CheckpointManager, atomic_torch_save
from speedtronic.train.runtime import build_runtime, train_from_config


def small_config(tmp_path, **sections) -> dict:
    values = {
        "run": {"seed": 3, "device": "cpu", "max_steps": 4, "output_dir": str(tmp_path)},
        "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"num_tokens": 40, "micro_batch_size": 2, "target_batch_size": 2},
        "optimizer": {"lr": 1e-2},
        "scheduler": {"warmup_steps": 1},
        "precision": "fp32",
        "checkpoint": {"every_steps": 2, "keep_last": None},
        "logging": {"level": "WARNING", "file": str(tmp_path / "log.txt")},
    }
    for section, fields in sections.items():
        values.setdefault(section, {}).update(fields)
    return values


def test_newest_is_the_recorded_step_not_the_file_name(tmp_path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save(5, {"step": 5, "model": {"w": torch.ones(2)}})
    atomic_torch_save(
        {"step": 2, "model": {"w": torch.zeros(2)}}, tmp_path / "step_999999999999.pt"
    )
    assert manager.load_latest()["step"] == 5
    assert manager.latest_path().name == "step_000000000005.pt"


def test_files_that_record_no_valid_step_are_skipped(tmp_path) -> None:
    warnings: list[str] = []
    manager = CheckpointManager(tmp_path, keep_last=None, warn=warnings.append)
    manager.save(5, {"step": 5, "model": {}})
    for name, step in [("step_000000000009.pt", "nine"), ("step_000000000008.pt", -1)]:
        atomic_torch_save({"step": step, "model": {}}, tmp_path / name)
    atomic_torch_save({"step": True, "model": {}}, tmp_path / "step_000000000007.pt")
    assert manager.load_latest()["step"] == 5
    assert len(warnings) == 3 and all("records no valid step" in w for w in warnings)
    assert all("falling back to step_000000000005.pt" in w for w in warnings)


def _plant(tmp_path, name: str, config: dict, *, step: int) -> None:
    """Train ``config`` (in a scratch directory) and copy its last checkpoint, renamed to
    ``name`` with ``step`` recorded, into the run's checkpoint directory."""
    scratch = tmp_path / f"scratch-{name}"
    config = {**config, "run": {**config["run"], "output_dir": str(scratch)}}
    config["logging"] = {"level": "WARNING", "file": str(scratch / "log.txt")}
    train_from_config(config)
    state = CheckpointManager(scratch / "checkpoints").load_latest()
    state.pop("path", None)
    state["step"] = step
    atomic_torch_save(state, tmp_path / "checkpoints" / name)


def test_resume_falls_back_past_incompatible_checkpoints(tmp_path) -> None:
    base = small_config(tmp_path)
    train_from_config(base)  # checkpoints at steps 2 and 4
    _plant(tmp_path, "step_000000000010.pt", small_config(tmp_path, model={"d_model": 48}), step=10)
    _plant(
        tmp_path, "step_000000000009.pt", small_config(tmp_path, optimizer={"name": "muon"}), step=9
    )
    _plant(tmp_path, "step_000000000008.pt", small_config(tmp_path), step=8)
    bad = torch.load(tmp_path / "checkpoints/step_000000000008.pt", weights_only=True)
    bad["samples"] = -5
    atomic_torch_save(bad, tmp_path / "checkpoints/step_000000000008.pt")
    (tmp_path / "checkpoints/step_000000000011.pt").write_bytes(b"torn")

    trainer, _ = build_runtime({**base, "run": {**base["run"], "max_steps": 6}}, resume=True)
    assert trainer.step == 4  # the newest checkpoint this run can use
    trainer.logger.close()
    log = (tmp_path / "log.txt").read_text()
    assert "step_000000000011.pt is unreadable" in log
    assert "step_000000000010.pt is for another model" in log
    assert "step_000000000009.pt has other optimizer groups" in log
    assert "step_000000000008.pt records an invalid samples" in log
    assert log.count("falling back to") == 4


def test_resume_with_no_usable_checkpoint_is_a_clear_error(tmp_path) -> None:
    base = small_config(tmp_path)
    (tmp_path / "checkpoints").mkdir(parents=True)
    _plant(tmp_path, "step_000000000010.pt", small_config(tmp_path, model={"d_model": 48}), step=10)
    try:
        build_runtime(base, resume=True)
    except CheckpointError as exc:
        message = str(exc)
    else:  # pragma: no cover - the assertion below reports it
        message = ""
    assert "no readable checkpoint" in message and "that this run can use" in message
    assert "step_000000000010.pt is for another model" in message


def test_checkpoint_resume_with_nothing_saved_starts_fresh(tmp_path) -> None:
    trainer, _ = build_runtime(small_config(tmp_path, checkpoint={"resume": True}))
    assert trainer.step == 0
    trainer.logger.close()
    assert "no local checkpoint was found" in (tmp_path / "log.txt").read_text()
