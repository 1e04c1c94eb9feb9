"""issue 21 item 4: the token's value, whatever its shape, appears in no output, even when the
same value was also put into other fields; a secret file others can read is warned about.

Since issue 31 item 3 the layered config (files, env, secrets, ``--set``) refuses the token's
value in any other field (a name built from it would become a directory); a config built
directly (``SpeedtronicConfig.from_dict``, no layering) keeps it and every serialisation
scrubs it."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from speedtronic.cli import main
from speedtronic.config import ConfigError, SpeedtronicConfig, resolve_config

ODD_TOKEN = "Zq7-not-shaped-like-hf-9f8e7d"  # no `hf_` prefix: no pattern would find it


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A config that carries the token in run.name, distributed.repo_id and
    distributed.cache_dir, with the token itself from a secret file."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "hf_token").write_text(ODD_TOKEN + "\n")
    os.chmod(secrets / "hf_token", 0o600)
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run:\n  name: run-{ODD_TOKEN}\n  output_dir: {tmp_path / 'out'}\n"
        f"distributed:\n  repo_id: owner/{ODD_TOKEN}\n  cache_dir: cache-{ODD_TOKEN}\n"
    )
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(secrets))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return path


def _built_directly(planted) -> SpeedtronicConfig:
    """The planted config with its token, built without the layering (the API path)."""
    values = yaml.safe_load(planted.read_text())
    values["distributed"]["token"] = ODD_TOKEN
    return SpeedtronicConfig.from_dict(values)


def test_the_layering_refuses_the_token_in_other_fields(planted) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_config(str(planted))
    message = str(caught.value)
    assert message.startswith("run.name holds the value of distributed.token (not shown)")
    assert ODD_TOKEN.lower() not in message.lower()


def test_token_planted_in_other_fields_is_scrubbed_from_every_serialisation(planted) -> None:
    config = _built_directly(planted)
    assert config.distributed.token == ODD_TOKEN
    assert config.run.name == f"run-{ODD_TOKEN}"  # the value itself is kept for the run
    redacted = config.to_dict(redact_secrets=True)
    assert ODD_TOKEN not in json.dumps(redacted)
    assert redacted["run"]["name"] == "run-<redacted>"
    assert redacted["distributed"]["repo_id"] == "owner/<redacted>"
    assert ODD_TOKEN not in config.to_yaml(redact_secrets=True)
    assert ODD_TOKEN not in repr(config)
    saved = config.save(planted.parent / "saved.json")
    assert ODD_TOKEN not in saved.read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["validate"],
        ["validate", "--format", "json"],
        ["config", "show", "--sources"],
        ["config", "show", "--format", "json"],
    ],
)
def test_cli_output_never_shows_the_token(planted, capsys, argv) -> None:
    argv = [*argv, "--config", str(planted)] if argv[0] == "validate" else [*argv]
    if argv[0] == "config":
        argv += ["--config", str(planted)]
    assert main(argv) == 2  # the layering refuses the token in run.name (issue 31)
    captured = capsys.readouterr()
    assert ODD_TOKEN.lower() not in (captured.out + captured.err).lower()
    assert "run.name holds the value of distributed.token" in captured.err


def test_an_error_never_shows_the_token(planted, capsys) -> None:
    code = main(["validate", "--config", str(planted), "--set", f"run.max_steps={ODD_TOKEN}"])
    err = capsys.readouterr().err
    assert code == 2 and "run.max_steps" in err and ODD_TOKEN not in err


def test_group_readable_secret_file_is_warned_about(tmp_path, caplog) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    token_file = secrets / "hf_token"
    token_file.write_text(ODD_TOKEN)
    os.chmod(token_file, 0o640)
    with caplog.at_level("WARNING", logger="speedtronic.config"):
        resolve_config({}, environ={}, secrets_dir=str(secrets))
    assert f"secret file {token_file} is readable by group/others" in caplog.text
    assert ODD_TOKEN not in caplog.text
    caplog.clear()
    os.chmod(token_file, 0o600)
    with caplog.at_level("WARNING", logger="speedtronic.config"):
        resolve_config({}, environ={}, secrets_dir=str(secrets))
    assert "readable by group/others" not in caplog.text


def test_checkpoint_config_record_is_redacted(planted) -> None:
    """Checkpoints store ``config.to_dict(redact_secrets=True)`` (train/state.py)."""
    config = _built_directly(planted)
    record = SpeedtronicConfig.from_dict(config.to_dict(redact_secrets=True))
    assert ODD_TOKEN not in json.dumps(record.to_dict())
