"""issue 21 item 5: experiment trackers from the config (``logging.trackers``), settable from
YAML, the environment and ``--set``; the libraries are optional extras (tests skip without
them and use their offline modes)."""

from __future__ import annotations

import pytest

from speedtronic import entrypoint
from speedtronic.config import ConfigError, SpeedtronicConfig, resolve_config


def test_trackers_from_yaml_env_and_set(tmp_path) -> None:
    config = SpeedtronicConfig.from_dict({"logging": {"trackers": ["TensorBoard", "wandb"]}})
    assert config.logging.trackers == ["tensorboard", "wandb"]
    env = {"SPEEDTRONIC_LOGGING__TRACKERS": "[wandb]", "SPEEDTRONIC_LOGGING__PROJECT": "p"}
    resolved = resolve_config({}, environ=env, secrets_dir=str(tmp_path / "none"))
    assert resolved.config.logging.trackers == ["wandb"]
    assert resolved.config.logging.project == "p"
    assert resolved.sources["logging.trackers"] == "env:SPEEDTRONIC_LOGGING__TRACKERS"
    cli = resolve_config(
        {}, environ={}, secrets_dir=str(tmp_path / "none"), overrides=["logging.trackers=[]"]
    )
    assert cli.config.logging.trackers == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["mlflow"], r"^logging.trackers\[0\] must be 'tensorboard' or 'wandb', got str 'mlflow'"),
        ("wandb", r"^logging.trackers must be a valid list, got str 'wandb'"),
        ([1], r"^logging.trackers\[0\] must be 'tensorboard' or 'wandb', got int 1"),
    ],
)
def test_unknown_tracker_is_refused(value, expected) -> None:
    with pytest.raises(ConfigError, match=expected):
        SpeedtronicConfig.from_dict({"logging": {"trackers": value}})


def _missing(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return True
    return False


@pytest.mark.skipif(not _missing("wandb"), reason="wandb is installed")
def test_a_tracker_that_is_not_installed_is_a_config_error() -> None:
    config = SpeedtronicConfig.from_dict({"logging": {"trackers": ["wandb"]}})
    with pytest.raises(ConfigError, match=r"^logging.trackers: wandb: install speedtronic"):
        entrypoint._trackers(config, "node-1")


def test_tensorboard_gets_the_redacted_config_and_scalars(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = SpeedtronicConfig.from_dict(
        {
            "run": {"name": "tb-run", "output_dir": str(tmp_path)},
            "logging": {"trackers": ["tensorboard"]},
            "distributed": {"token": "tb-secret-value"},
        }
    )
    (hook,) = entrypoint._trackers(config, "node-7")
    hook.on_event("train_step", {"step": 1, "loss": 2.5})
    hook.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "node-7"))
    events.Reload()
    assert events.Scalars("train_step/loss")[0].value == 2.5
    text = str(events.Tensors("config/text_summary")[0].tensor_proto)
    assert "tb-run" in text and "tb-secret-value" not in text


def test_wandb_offline_gets_project_run_name_and_redacted_config(tmp_path, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    config = SpeedtronicConfig.from_dict(
        {
            "run": {"name": "wb-run"},
            "logging": {"trackers": ["wandb"]},
            "distributed": {"token": "wb-secret-value"},
        }
    )
    (hook,) = entrypoint._trackers(config, "node-3")
    run = wandb.run
    assert run.project == "wb-run" and run.name == "node-3"
    assert run.config["distributed"]["token"] == "<redacted>"
    hook.on_event("train_step", {"step": 1, "loss": 2.5})
    hook.close()
