"""Issue 39: what arrives with a checkpoint is data, never an instruction.

Item 1: the config a checkpoint carries (a ``.pt``'s ``config`` entry, a ``final/`` folder's
``config.yaml``) cannot switch on pickle loading, a remote ``init_from``, a push or a tracker:
``eval``/``sample``/``export``/``push --checkpoint X`` without ``--config`` set those back to
their defaults and say so in one line. Only the user's own layers (``--config``, secret
files, the environment, ``--set``) can set them.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic.checkpoint import checkpoint_config
from speedtronic.cli import main
from speedtronic.config import SpeedtronicConfig
from speedtronic.model import build_model

MODEL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


class _Opens:
    """Unpickling this calls ``open(path, "w")``: the file appears only if code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _hostile_values(tmp_path: Path) -> dict:
    """A run config that asks for a pickled dataset whose unpickling creates ``marker``."""
    dataset = tmp_path / "dataset.pt"
    torch.save({"input_ids": _Opens(tmp_path / "marker")}, dataset, pickle_protocol=2)
    return {
        "run": {"device": "cpu", "push_to_hub": "attacker/loot"},
        "model": dict(MODEL, init_from="attacker/model"),
        "data": {"dataset": str(dataset), "allow_pickle": True},
        "logging": {"trackers": ["tensorboard"]},
        "eval": {"holdout": 0.5, "tokens": 64},
    }


@pytest.fixture(autouse=True)
def _no_user_config(monkeypatch, tmp_path):
    monkeypatch.delenv("SPEEDTRONIC_CONFIG", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(tmp_path / "no-secrets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a remote init_from must not be tried at all


def _weights() -> dict:
    return {
        k: v.clone()
        for k, v in build_model(SpeedtronicConfig.from_dict({"model": MODEL}).model)
        .state_dict()
        .items()
    }


def _pt_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step_000000000001.pt"
    torch.save({"model": _weights(), "step": 1, "config": _hostile_values(tmp_path)}, path)
    return path


def _final_folder(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    final = tmp_path / "final"
    final.mkdir()
    save_file(_weights(), str(final / "model.safetensors"))
    (final / "config.yaml").write_text(yaml.safe_dump(_hostile_values(tmp_path)))
    return final


@pytest.mark.parametrize("make", [_pt_checkpoint, _final_folder], ids=["pt", "final"])
def test_eval_from_a_checkpoint_never_unpickles_what_its_config_names(make, tmp_path, capsys):
    checkpoint = make(tmp_path)
    assert pickle.loads(pickle.dumps(_Opens(tmp_path / "probe"))) and (tmp_path / "probe").exists()
    code = main(["eval", "--checkpoint", str(checkpoint)])
    err = capsys.readouterr().err
    assert not (tmp_path / "marker").exists(), "the checkpoint's config ran code"
    assert code == 2, err
    said = [line for line in err.splitlines() if "ignored" in line]
    assert len(said) == 1, err
    for field in ("data.allow_pickle", "model.init_from", "run.push_to_hub", "logging.trackers"):
        assert field in said[0]
    assert "allow_pickle" in err.splitlines()[-1]  # the dataset is refused as pickled


def test_the_user_can_still_opt_in_on_the_command_line(tmp_path, capsys):
    checkpoint = _pt_checkpoint(tmp_path)
    main(["eval", "--checkpoint", str(checkpoint), "--set", "data.allow_pickle=true"])
    capsys.readouterr()
    assert (tmp_path / "marker").exists()  # the user's own layer may (and it did run)


def test_checkpoint_config_drops_what_only_the_user_may_set(tmp_path):
    values = checkpoint_config(_pt_checkpoint(tmp_path))
    assert "allow_pickle" not in values["data"] and "init_from" not in values["model"]
    assert "push_to_hub" not in values["run"] and "trackers" not in values["logging"]
    assert values["data"]["dataset"] == str(tmp_path / "dataset.pt")  # a path stays data
    assert values["model"]["d_model"] == 32
