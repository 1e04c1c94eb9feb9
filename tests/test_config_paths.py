"""Paths follow the run: relative log, checkpoint and DiLoCo-state paths are under
``run.output_dir``; the 2.0.0 spelling of a log path (output dir written out) keeps its file;
unknown ``SPEEDTRONIC_*`` names name the closest field; retired one-value settings still load."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from speedtronic.cli import main
from speedtronic.config import ConfigError, SpeedtronicConfig, resolve_config
from speedtronic.config.layering import closest_env_name

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


@pytest.fixture
def no_secrets(tmp_path: Path) -> Path:
    return tmp_path / "no-secrets"


# --------------------------------------------------------------------------- resolution
def test_relative_paths_are_under_output_dir_and_absolute_paths_unchanged(tmp_path) -> None:
    config = SpeedtronicConfig.from_dict(
        {
            "output_dir": "runs/a",
            "logging": {"json_file": "events.jsonl", "file": "logs/train.log"},
            "checkpoint": {"directory": "ckpt"},
            "distributed": {"state_dir": "state"},
        }
    )
    assert config.events_path == Path("runs/a/events.jsonl")
    assert config.text_log_path == Path("runs/a/logs/train.log")
    assert config.checkpoint_dir == Path("runs/a/ckpt")
    assert config.state_dir == Path("runs/a/state")
    absolute = SpeedtronicConfig.from_dict(
        {
            "output_dir": "runs/a",
            "logging": {"json_file": str(tmp_path / "e.jsonl"), "file": str(tmp_path / "t.log")},
            "checkpoint": {"directory": str(tmp_path / "ck")},
        }
    )
    assert absolute.events_path == tmp_path / "e.jsonl"
    assert absolute.text_log_path == tmp_path / "t.log"
    assert absolute.checkpoint_dir == tmp_path / "ck"
    unset = SpeedtronicConfig.from_dict({"output_dir": "runs/a"})
    assert unset.events_path is None and unset.text_log_path is None


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_write_events_into_their_output_dir(path, no_secrets) -> None:
    raw = path.read_text()
    assert "json_file: events.jsonl" in raw  # relative to output_dir, no prefix to double
    resolved = resolve_config(path, environ={}, secrets_dir=no_secrets).config
    assert resolved.events_path == Path(resolved.run.output_dir) / "events.jsonl"
    moved = resolve_config(
        path,
        environ={"SPEEDTRONIC_RUN__OUTPUT_DIR": "/data/runs/w1"},
        secrets_dir=no_secrets,
        overrides=[],
    ).config
    assert moved.events_path == Path("/data/runs/w1/events.jsonl")
    flag = resolve_config(path, environ={}, secrets_dir=no_secrets, overrides=["run.output_dir=b"])
    assert flag.config.events_path == Path("b/events.jsonl")


# --------------------------------------------------------------------------- the 2.0.0 form
V2_FILE = """
output_dir: runs/smoke
max_steps: 4
logging:
  json_file: runs/smoke/events.jsonl
  file: runs/smoke/logs/train.log
checkpoint:
  directory: runs/smoke/ckpt
"""


def test_a_2_0_0_log_path_keeps_its_file_and_warns(tmp_path, no_secrets, caplog) -> None:
    source = tmp_path / "v2.yaml"
    source.write_text(V2_FILE)
    with caplog.at_level(logging.WARNING, logger="speedtronic.config"):
        config = resolve_config(source, environ={}, secrets_dir=no_secrets).config
    # The same files as 2.0.0 (relative to the working directory) ...
    assert config.events_path == Path("runs/smoke/events.jsonl")
    assert config.text_log_path == Path("runs/smoke/logs/train.log")
    assert config.logging.json_file == "events.jsonl"
    # ... checkpoint.directory was already under output_dir in 2.0.0: unchanged meaning.
    assert config.checkpoint_dir == Path("runs/smoke/runs/smoke/ckpt")
    warned = [r.getMessage() for r in caplog.records if "logging.json_file" in r.getMessage()]
    assert len(warned) == 1 and "write events.jsonl" in warned[0]
    # A new output dir (flag or env) moves the 2.0.0 log with the run.
    for overrides, environ in (
        (["run.output_dir=runs/other"], {}),
        ([], {"SPEEDTRONIC_RUN__OUTPUT_DIR": "runs/other"}),
    ):
        moved = resolve_config(source, environ=environ, secrets_dir=no_secrets, overrides=overrides)
        assert moved.config.events_path == Path("runs/other/events.jsonl")


def test_the_2_0_0_rule_is_stable_across_save_and_load(tmp_path) -> None:
    config = SpeedtronicConfig.from_dict(
        {"output_dir": "runs/x", "logging": {"json_file": "runs/x/sub/e.jsonl"}}
    )
    assert config.events_path == Path("runs/x/sub/e.jsonl")
    again = SpeedtronicConfig.from_dict(config.to_dict())
    assert again.logging.json_file == "sub/e.jsonl" and again.events_path == config.events_path
    # Without output_dir the 2.0.0 default (runs) is the prefix; other relative paths, the
    # output dir itself and absolute output dirs are left alone.
    default = SpeedtronicConfig.from_dict({"logging": {"json_file": "runs/e.jsonl"}})
    assert default.events_path == Path("runs/e.jsonl")
    for output_dir, path in (("runs/x", "runs/y/e.jsonl"), ("runs/x", "runs/x"), ("/abs", "e")):
        plain = SpeedtronicConfig.from_dict(
            {"output_dir": output_dir, "logging": {"json_file": path}}
        )
        assert plain.logging.json_file == path


def test_two_output_dirs_give_two_event_files(tmp_path, monkeypatch, capsys) -> None:
    """The issue's report: a second run with another --output-dir used to append to the first
    run's events.jsonl. Now each run writes its own file, each record with its run id."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("a", "b"):
        code = main(
            [
                "train",
                "--config",
                str(REPO / "configs" / "smoke.yaml"),
                "--output-dir",
                f"runs/{name}",
                "--max-steps",
                "2",
                "--device",
                "cpu",
                "--set",
                "eval.every_steps=1000",
            ]
        )
        assert code == 0, capsys.readouterr().err
    run_ids = []
    for name in ("a", "b"):
        lines = Path(f"runs/{name}/events.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        steps = [r["step"] for r in records if r["event"] == "train_step"]
        assert steps == [1, 2]
        ids = {r["run_id"] for r in records}
        assert len(ids) == 1
        run_ids += ids
    assert run_ids[0] != run_ids[1]
    assert not Path("runs/smoke").exists()


# --------------------------------------------------------------------------- env names
@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("SPEEDTRONIC_RUN__MAX_STEP", "SPEEDTRONIC_RUN__MAX_STEPS"),
        ("SPEEDTRONIC_RUN_MAX_STEPS", "SPEEDTRONIC_RUN__MAX_STEPS"),
        ("SPEEDTRONIC_MAX_STEPS", "SPEEDTRONIC_RUN__MAX_STEPS"),
        ("SPEEDTRONIC_OPTIMISER__LR", "SPEEDTRONIC_OPTIMIZER__LR"),
        ("SPEEDTRONIC_LOGING__JSON_FILE", "SPEEDTRONIC_LOGGING__JSON_FILE"),
        ("SPEEDTRONIC_HUB__REPO_ID", "SPEEDTRONIC_DISTRIBUTED__REPO_ID"),
        ("SPEEDTRONIC_DISTRIBUTED_ROLE", "SPEEDTRONIC_DISTRIBUTED__ROLE"),
        ("SPEEDTRONIC_NODEID", "SPEEDTRONIC_NODE_ID"),
        ("SPEEDTRONIC_CONFG", "SPEEDTRONIC_CONFIG"),
        ("speedtronic_run__seeds", "SPEEDTRONIC_RUN__SEED"),
    ],
)
def test_an_unknown_env_name_is_an_error_naming_the_closest_field(
    name, suggestion, no_secrets
) -> None:
    """An error, like an unknown key in a config file (a typo must never be ignored)."""
    assert closest_env_name(name) == suggestion
    with pytest.raises(ConfigError) as info:
        resolve_config(REPO / "configs/smoke.yaml", environ={name: "1"}, secrets_dir=no_secrets)
    message = str(info.value)
    assert message.startswith(f"unknown environment variable {name}")
    assert message.endswith(f"(did you mean {suggestion}?)")


def test_a_name_like_nothing_gets_no_guess(no_secrets) -> None:
    assert closest_env_name("SPEEDTRONIC_FOO") is None
    with pytest.raises(ConfigError, match="SPEEDTRONIC_FOO") as info:
        resolve_config(environ={"SPEEDTRONIC_FOO": "1"}, secrets_dir=no_secrets)
    assert "did you mean" not in str(info.value)


def test_compose_interpolation_variables_are_not_config_errors(no_secrets) -> None:
    """The host shell exports these for `docker compose`; `speedtronic` in the same shell works."""
    compose = (REPO / "compose.yaml").read_text() + (REPO / "compose.hub.yaml").read_text()
    names = {
        part.split("}")[0].split(":")[0].split("-")[0]
        for part in compose.split("${")[1:]
        if part.startswith("SPEEDTRONIC_")
    }
    assert "SPEEDTRONIC_CPUS" in names
    resolve_config(environ=dict.fromkeys(names, "1"), secrets_dir=no_secrets)


# --------------------------------------------------------------------------- retired settings
def test_retired_one_value_settings_load_at_their_value_and_are_dropped(caplog) -> None:
    """2.0.0 saved configs carry delta_upload_queue_size: 1 and delta_upload_overflow: skip."""
    with caplog.at_level(logging.WARNING, logger="speedtronic.config"):
        config = SpeedtronicConfig.from_dict(
            {"distributed": {"delta_upload_queue_size": 1, "delta_upload_overflow": "SKIP"}}
        )
    assert "delta_upload_queue_size" not in config.to_dict()["distributed"]
    assert not hasattr(config.distributed, "delta_upload_overflow")
    assert sum("is retired" in r.getMessage() for r in caplog.records) == 2
    for bad, message in (
        (
            {"delta_upload_queue_size": 2},
            "distributed.delta_upload_queue_size is retired: it must be 1 or absent",
        ),
        ({"delta_upload_queue_size": "x"}, "distributed.delta_upload_queue_size"),
        (
            {"delta_upload_overflow": "block"},
            "distributed.delta_upload_overflow is retired: it must be skip or absent",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            SpeedtronicConfig.from_dict({"distributed": bad})
