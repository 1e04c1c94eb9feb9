"""issue 21: what the field declarations publish (JSON Schema, docs tables) and the errors a
person can act on (a typo names the file and the nearest field, absurd values are refused)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from speedtronic.cli import main
from speedtronic.config import (
    ConfigError,
    SpeedtronicConfig,
    load_config,
    reference,
    resolve_config,
)
from speedtronic.config.schema import field_infos

REPO = Path(__file__).resolve().parents[1]
SCHEMA_FILE = REPO / "docs" / "speedtronic.schema.json"
SCHEMA_LINE = "# yaml-language-server: $schema=../docs/speedtronic.schema.json"
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schema_is_the_models_schema() -> None:
    """Regenerate with `speedtronic config schema > docs/speedtronic.schema.json`."""
    assert SCHEMA_FILE.read_text() == reference.schema_text()


def test_config_schema_command_prints_it(capsys) -> None:
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == reference.json_schema()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_names_and_passes_the_schema(path) -> None:
    assert path.read_text().splitlines()[0] == SCHEMA_LINE
    errors = [e.message for e in _validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize(
    "document",
    [
        {"data": {"micro_batch_sise": 2}},
        {"optimizer": {"lr": 1e300}},
        {"bogus": 1},
        {"precision": {"mode": "fp8"}},
        {"run": {"max_steps": 0}},
    ],
)
def test_schema_refuses_what_the_loader_refuses(document) -> None:
    assert list(_validator().iter_errors(document))
    with pytest.raises(ConfigError):
        SpeedtronicConfig.from_dict(document)


def test_schema_accepts_the_2_0_0_forms() -> None:
    document = {
        "max_steps": 4,
        "name": "x",
        "hub": {"inner_steps": 3},
        "optimizer": "muon",
        "muon_plus": True,
        "precision": "bf16",
        "compile": {"enabled": True},
    }
    assert list(_validator().iter_errors(document)) == []
    assert SpeedtronicConfig.from_dict(document).distributed.inner_steps == 3


def test_docs_field_tables_are_generated_from_the_models() -> None:
    """Regenerate with `speedtronic config docs --write docs/configuration.md`."""
    docs = (REPO / "docs" / "configuration.md").read_text()
    block = docs[docs.index(reference.BEGIN) : docs.index(reference.END) + len(reference.END)]
    assert block + "\n" == reference.field_tables()
    for dotted in field_infos():
        assert f"| `{dotted.rsplit('.', 1)[-1]}` |" in block


def test_docs_write_replaces_only_the_generated_block(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"intro\n\n{reference.BEGIN}\nSTALE-LINE\n{reference.END}\n\noutro\n")
    assert main(["config", "docs", "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n\n") and text.endswith("\n\noutro\n")
    assert "STALE-LINE" not in text and "| `max_steps` |" in text


def test_every_field_has_help() -> None:
    missing = [dotted for dotted, info in field_infos().items() if not info.description]
    assert missing == []


# --------------------------------------------------------------------------- actionable errors
def test_unknown_yaml_key_names_the_file_and_the_nearest_field(tmp_path, capsys) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("data:\n  micro_batch_sise: 2\n")
    with pytest.raises(ConfigError) as info:
        SpeedtronicConfig.from_yaml(path)
    message = str(info.value)
    assert message == (
        f"data: unknown configuration keys: micro_batch_sise in {path} "
        "(did you mean micro_batch_size?)"
    )
    code = main(["validate", "--config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and "did you mean micro_batch_size?" in err
    root = tmp_path / "root.yaml"
    root.write_text("max_step: 3\n")
    with pytest.raises(ConfigError, match=r"max_step in .*root.yaml \(did you mean max_steps\?\)"):
        resolve_config(str(root), environ={}, secrets_dir=str(tmp_path / "none"))


def test_unknown_key_from_a_mapping_has_no_file() -> None:
    with pytest.raises(ConfigError, match=r"^model: unknown configuration keys: n_layers "):
        SpeedtronicConfig.from_dict({"model": {"n_layers": 2}})


@pytest.mark.parametrize("lr", [1e300, 11.0, "1e300"])
def test_absurd_learning_rate_is_refused(lr) -> None:
    with pytest.raises(
        ConfigError, match=r"^optimizer.lr must be less than or equal to 10, got float"
    ):
        load_config({"optimizer": {"lr": lr}})


@pytest.mark.parametrize("host", ["256.1.1.1", "1.2.3.4.5", "bad host", "-x", "a..b"])
def test_bad_metrics_host_is_refused_at_load(host) -> None:
    with pytest.raises(ConfigError, match=r"^metrics.host must be an IP address or a host name"):
        load_config({"metrics": {"host": host}})


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", "::", "[::1]", "localhost", "pod-0.svc"])
def test_good_metrics_hosts_load(host) -> None:
    assert load_config({"metrics": {"host": host}}).metrics.host == host


def test_empty_config_file_says_so(tmp_path, caplog, capsys) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    with caplog.at_level("WARNING", logger="speedtronic.config"):
        config = SpeedtronicConfig.from_yaml(path)
    assert config.to_dict() == SpeedtronicConfig().to_dict()  # 2.0.0: defaults
    assert f"{path} is empty" in caplog.text
    assert main(["validate", "--config", str(path)]) == 0
    assert f"warning: {path} is empty" in capsys.readouterr().err


def test_a_non_local_metrics_host_blames_the_host_not_the_port() -> None:
    from speedtronic import entrypoint

    with pytest.raises(ConfigError, match=r"^metrics.host: 192.0.2.77 is not an address of"):
        entrypoint._check_local_host("192.0.2.77")  # TEST-NET-1: never this machine's
    with pytest.raises(ConfigError, match=r"^metrics.host: cannot resolve"):
        entrypoint._check_local_host("no-such-host.invalid")
    entrypoint._check_local_host("127.0.0.1")
    entrypoint._check_local_host("0.0.0.0")
