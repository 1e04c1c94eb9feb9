"""issue 21 item 6: ``export``/``sample``/``eval`` from a checkpoint alone (no ``--config``):
a trainer checkpoint, a checkpoint directory and a DiLoCo ``final/`` folder carry their run
config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic.checkpoint import CheckpointError, checkpoint_config
from speedtronic.cli import main
from speedtronic.config import SpeedtronicConfig
from speedtronic.train.runtime import train_from_config

TOKEN = "plain-secret-value-42"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 4-step run with a token and the token also in run.name; returns its output dir."""
    root = tmp_path_factory.mktemp("trained")
    values = {
        "run": {
            "name": f"n-{TOKEN}",
            "device": "cpu",
            "max_steps": 4,
            "output_dir": str(root / "run"),
        },
        "model": {"vocab_size": 256, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"num_tokens": 32, "micro_batch_size": 2, "target_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "checkpoint": {"every_steps": 2},
        "logging": {"level": "WARNING"},
        "distributed": {"token": TOKEN},
    }
    train_from_config(SpeedtronicConfig.from_dict(values))
    return root / "run"


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SPEEDTRONIC_CONFIG", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(tmp_path / "no-secrets"))


def test_checkpoint_config_is_the_redacted_run_config(trained) -> None:
    for path in (trained / "checkpoints", *sorted((trained / "checkpoints").glob("*.pt"))):
        values = checkpoint_config(path)
        assert values["model"]["d_model"] == 32
        assert TOKEN not in json.dumps(values)
    with pytest.raises(CheckpointError, match="carries no run config"):
        checkpoint_config(trained / "nothing-here.safetensors")


def test_sample_from_a_checkpoint_alone(trained, capsys) -> None:
    argv = ["sample", "--checkpoint", str(trained / "checkpoints"), "--prompt", "ab"]
    assert main([*argv, "--max-new-tokens", "5", "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("ab")
    assert main([*argv, "--max-new-tokens", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first


def test_export_from_a_checkpoint_file_alone(trained, tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    checkpoint = sorted((trained / "checkpoints").glob("*.pt"))[-1]
    out = tmp_path / "hf"
    code = main(["export", "--checkpoint", str(checkpoint), "--format", "hf", "--output", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (out / "model.safetensors").is_file()
    provenance = (out / "speedtronic.json").read_text()
    assert TOKEN not in provenance and json.loads(provenance)["step"] == 4


def test_export_from_a_final_folder_alone(trained, tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    checkpoint = sorted((trained / "checkpoints").glob("*.pt"))[-1]
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    final = tmp_path / "final"
    final.mkdir()
    weights = {k: v.clone().contiguous() for k, v in state["model"].items()}
    save_file(weights, str(final / "model.safetensors"))
    (final / "config.yaml").write_text(yaml.safe_dump(state["config"]))
    (final / "meta.json").write_text(json.dumps({"outer_step": 2, "step": 4}))
    code = main(["export", "--checkpoint", str(final), "--output", str(tmp_path / "hf")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "hf" / "speedtronic.json").read_text())["outer_step"] == 2


def test_without_config_or_usable_checkpoint_exit_2(tmp_path, capsys) -> None:
    assert main(["export", "--output", str(tmp_path / "hf")]) == 2
    assert "no configuration given" in capsys.readouterr().err
    bogus = tmp_path / "x.safetensors"
    bogus.write_bytes(b"")
    assert main(["sample", "--checkpoint", str(bogus), "--prompt", "a"]) == 2
    assert "carries no run config" in capsys.readouterr().err
