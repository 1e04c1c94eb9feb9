"""resolve_config: file < secret files < environment < CLI overrides, with provenance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from speedtronic.config import ConfigError, resolve_config
from speedtronic.config.layering import env_name_for, known_fields

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")


@pytest.fixture
def no_secrets(tmp_path) -> str:
    return str(tmp_path / "no-secrets")


def _write_secrets(directory: Path, **files: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return str(directory)


def test_file_only(no_secrets) -> None:
    resolved = resolve_config(SMOKE, environ={}, secrets_dir=no_secrets)
    assert resolved.config.run.max_steps == 200
    assert resolved.sources["run.max_steps"] == "file"
    assert resolved.sources["model.n_layer"] == "file"
    assert "run.log_every" not in resolved.sources  # defaults are not listed
    assert "scheduler.max_steps" not in resolved.sources
    assert resolved.config_path == SMOKE


def test_env_beats_file_and_horizon_follows(no_secrets) -> None:
    resolved = resolve_config(
        SMOKE, environ={"SPEEDTRONIC_RUN__MAX_STEPS": "7"}, secrets_dir=no_secrets
    )
    assert resolved.config.run.max_steps == 7
    assert resolved.config.scheduler.max_steps == 7
    assert resolved.sources["run.max_steps"] == "env:SPEEDTRONIC_RUN__MAX_STEPS"


def test_cli_beats_env(no_secrets) -> None:
    resolved = resolve_config(
        SMOKE,
        environ={"SPEEDTRONIC_RUN__MAX_STEPS": "7"},
        secrets_dir=no_secrets,
        overrides=["run.max_steps=9"],
    )
    assert (resolved.config.run.max_steps, resolved.config.scheduler.max_steps) == (9, 9)
    assert resolved.sources["run.max_steps"] == "cli"


def test_env_values_are_yaml(no_secrets) -> None:
    environ = {
        "SPEEDTRONIC_OPTIMIZER__BETAS": "[0.8, 0.9]",
        "SPEEDTRONIC_OPTIMIZER__LR": "3e-4",
        "SPEEDTRONIC_COMPILE": "yes",
        "SPEEDTRONIC_RUN__NAME": "2024",
        "SPEEDTRONIC_RUN__LOG_EVERY": "null",
        "SPEEDTRONIC_DISTRIBUTED__COLLABORATORS": "[alice, bob]",
        "SPEEDTRONIC_SHAPE_VALIDATION__ALIGNMENT": "8",
        "speedtronic_checkpoint__keep_last": "5",
    }
    config = resolve_config(SMOKE, environ=environ, secrets_dir=no_secrets).config
    assert config.optimizer.betas == (0.8, 0.9)
    assert config.optimizer.lr == pytest.approx(3e-4)
    assert config.compile is True
    assert config.run.name == "2024"
    assert config.run.log_every is None
    assert config.distributed.collaborators == ["alice", "bob"]
    assert config.shape_validation.alignment == 8
    assert config.checkpoint.keep_last == 5


@pytest.mark.parametrize(
    "name",
    [
        "SPEEDTRONIC_FOO",
        "SPEEDTRONIC_RUN__MAX_STEP",
        "SPEEDTRONIC_MAX_STEPS",
        "SPEEDTRONIC_RUN",
        "SPEEDTRONIC_HUB__REPO_ID",
        "SPEEDTRONIC_MODEL__N_LAYER__X",
    ],
)
def test_unknown_speedtronic_variables_are_rejected(name, no_secrets) -> None:
    with pytest.raises(ConfigError, match=f"unknown environment variable {name}"):
        resolve_config(SMOKE, environ={name: "1"}, secrets_dir=no_secrets)


def test_alias_env_name_gets_a_hint(no_secrets) -> None:
    with pytest.raises(ConfigError, match="did you mean SPEEDTRONIC_RUN__MAX_STEPS"):
        resolve_config(SMOKE, environ={"SPEEDTRONIC_MAX_STEPS": "3"}, secrets_dir=no_secrets)


def test_every_field_has_an_env_name(no_secrets) -> None:
    names = {env_name_for(dotted) for dotted in known_fields()}
    assert "SPEEDTRONIC_RUN__MAX_STEPS" in names
    assert "SPEEDTRONIC_METRICS__PORT" in names
    assert "SPEEDTRONIC_OOO_STREAMS" in names
    environ = {"SPEEDTRONIC_METRICS__PORT": "9100", "SPEEDTRONIC_OOO_STREAMS": "2"}
    config = resolve_config(SMOKE, environ=environ, secrets_dir=no_secrets).config
    assert (config.metrics.port, config.ooo_streams) == (9100, 2)


def test_bad_env_value_names_field_and_variable(no_secrets) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(
            SMOKE, environ={"SPEEDTRONIC_RUN__MAX_STEPS": "lots"}, secrets_dir=no_secrets
        )
    message = str(info.value)
    assert message.startswith("run.max_steps must be an integer")
    assert "env:SPEEDTRONIC_RUN__MAX_STEPS" in message
    with pytest.raises(ConfigError, match=r"cannot parse value for optimizer\.betas"):
        resolve_config(
            SMOKE, environ={"SPEEDTRONIC_OPTIMIZER__BETAS": "[0.9,"}, secrets_dir=no_secrets
        )


def test_token_only_in_secret_file(tmp_path) -> None:
    secrets = _write_secrets(tmp_path / "secrets", hf_token="hf_from_secret\n")
    resolved = resolve_config(SMOKE, environ={}, secrets_dir=secrets)
    assert resolved.config.distributed.token == "hf_from_secret"
    assert resolved.sources["distributed.token"] == "secret:hf_token"
    assert "hf_from_secret" not in str(resolved.config.to_dict(redact_secrets=True))
    assert "hf_from_secret" not in repr(resolved.config)


def test_token_is_taken_verbatim(tmp_path) -> None:
    secrets = _write_secrets(tmp_path / "s", hf_token="123\n")
    assert resolve_config({}, environ={}, secrets_dir=secrets).config.distributed.token == "123"
    env = {"HF_TOKEN": "yes"}
    assert resolve_config({}, environ=env, secrets_dir=secrets).config.distributed.token == "yes"


def test_secret_precedence(tmp_path) -> None:
    secrets = _write_secrets(
        tmp_path / "s",
        hf_token="hf_a",
        distributed__token="hf_b",
        run__max_steps="11\n",
        unrelated_secret="ignored",
    )
    resolved = resolve_config(SMOKE, environ={}, secrets_dir=secrets)
    assert resolved.config.distributed.token == "hf_b"
    assert resolved.sources["distributed.token"] == "secret:distributed__token"
    assert resolved.config.run.max_steps == 11
    assert resolved.sources["run.max_steps"] == "secret:run__max_steps"
    env = {"HF_TOKEN": "hf_env", "SPEEDTRONIC_RUN__MAX_STEPS": "12"}
    resolved = resolve_config(SMOKE, environ=env, secrets_dir=secrets)
    assert resolved.config.distributed.token == "hf_env"
    assert resolved.sources["distributed.token"] == "env:HF_TOKEN"
    assert resolved.config.run.max_steps == 12
    env["SPEEDTRONIC_DISTRIBUTED__TOKEN"] = "hf_specific"
    resolved = resolve_config(SMOKE, environ=env, secrets_dir=secrets)
    assert resolved.config.distributed.token == "hf_specific"
    assert resolved.sources["distributed.token"] == "env:SPEEDTRONIC_DISTRIBUTED__TOKEN"


def test_secrets_dir_from_environment(tmp_path) -> None:
    secrets = _write_secrets(tmp_path / "s", hf_token="hf_x")
    resolved = resolve_config(SMOKE, environ={"SPEEDTRONIC_SECRETS_DIR": secrets})
    assert resolved.config.distributed.token == "hf_x"


def test_secrets_dir_problems(tmp_path) -> None:
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(ConfigError, match="secrets directory is not a directory"):
        resolve_config(SMOKE, environ={}, secrets_dir=str(not_dir))
    if os.geteuid() != 0:  # root can read anything
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0)
        try:
            with pytest.raises(ConfigError, match="not readable"):
                resolve_config(SMOKE, environ={}, secrets_dir=str(locked))
        finally:
            locked.chmod(0o700)


def test_kubernetes_style_secret_volume(tmp_path) -> None:
    root = tmp_path / "secrets"
    data = root / "..2026_01_01"
    data.mkdir(parents=True)
    (data / "hf_token").write_text("hf_k8s\n")
    (root / "..data").symlink_to(data.name)
    (root / "hf_token").symlink_to("..data/hf_token")
    resolved = resolve_config({}, environ={}, secrets_dir=str(root))
    assert resolved.config.distributed.token == "hf_k8s"
    assert resolved.sources == {"distributed.token": "secret:hf_token"}


def test_node_id_from_environment(no_secrets) -> None:
    resolved = resolve_config(
        {"distributed": {"node_id": "file-node"}},
        environ={"SPEEDTRONIC_NODE_ID": "worker-3"},
        secrets_dir=no_secrets,
    )
    assert resolved.config.distributed.node_id == "worker-3"
    assert resolved.sources["distributed.node_id"] == "env:SPEEDTRONIC_NODE_ID"
    both = resolve_config(
        {},
        environ={"SPEEDTRONIC_NODE_ID": "a", "SPEEDTRONIC_DISTRIBUTED__NODE_ID": "b"},
        secrets_dir=no_secrets,
    )
    assert both.config.distributed.node_id == "b"
    with pytest.raises(ConfigError, match="path-safe"):
        resolve_config({}, environ={"SPEEDTRONIC_NODE_ID": "../x"}, secrets_dir=no_secrets)


def test_config_path_from_environment(no_secrets) -> None:
    resolved = resolve_config(environ={"SPEEDTRONIC_CONFIG": SMOKE}, secrets_dir=no_secrets)
    assert resolved.config.run.name == "smoke"
    assert resolved.config_path == SMOKE
    explicit = resolve_config(
        {"name": "explicit"}, environ={"SPEEDTRONIC_CONFIG": SMOKE}, secrets_dir=no_secrets
    )
    assert explicit.config.run.name == "explicit"
    defaults = resolve_config(environ={}, secrets_dir=no_secrets)
    assert defaults.sources == {}


def test_layers_merge_field_by_field(no_secrets) -> None:
    resolved = resolve_config(
        "model: {n_layer: 3, d_model: 64, n_head: 4}\nprecision: bf16\noptimizer: muon\n",
        environ={"SPEEDTRONIC_MODEL__N_LAYER": "5", "SPEEDTRONIC_PRECISION__DTYPE": "fp16"},
        secrets_dir=no_secrets,
        overrides={"optimizer.lr": "1e-3", "max_steps": 3, "precision": "fp32"},
    )
    config = resolved.config
    assert (config.model.n_layer, config.model.d_model, config.model.n_head) == (5, 64, 4)
    assert (config.precision.mode, config.precision.dtype) == ("fp32", "fp16")
    assert (config.optimizer.name, config.optimizer.lr) == ("muon", 1e-3)
    assert config.run.max_steps == 3
    assert resolved.sources["model.n_layer"] == "env:SPEEDTRONIC_MODEL__N_LAYER"
    assert resolved.sources["model.d_model"] == "file"
    assert resolved.sources["precision.mode"] == "cli"
    assert resolved.sources["optimizer.name"] == "file"
    assert resolved.sources["run.max_steps"] == "cli"
    assert resolved.config_path is None


def test_explicit_horizon_survives_layers(no_secrets) -> None:
    resolved = resolve_config(
        {"max_steps": 10, "scheduler": {"max_steps": 100}},
        environ={"SPEEDTRONIC_RUN__MAX_STEPS": "50"},
        secrets_dir=no_secrets,
    )
    assert (resolved.config.run.max_steps, resolved.config.scheduler.max_steps) == (50, 100)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("run.max_steps", "expected section.field=value"),
        ("=3", "expected section.field=value"),
        ("run.bogus=1", "unknown configuration field"),
        ("bogus=1", "unknown configuration keys: bogus"),
        ("hub.repo_id=x", "unknown configuration field"),
        ("run.max_steps=-1", r"run.max_steps must be greater than 0, got int -1 \(from cli\)"),
    ],
)
def test_bad_overrides(override, match, no_secrets) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_config(SMOKE, environ={}, secrets_dir=no_secrets, overrides=[override])


def test_file_errors_are_config_errors(tmp_path, no_secrets) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        resolve_config(str(tmp_path / "nope.yaml"), environ={}, secrets_dir=no_secrets)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layer: [1,\n")
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        resolve_config(str(bad), environ={}, secrets_dir=no_secrets)


def test_sources_are_in_field_order(no_secrets) -> None:
    resolved = resolve_config(
        SMOKE,
        environ={"SPEEDTRONIC_COMPILE": "1", "SPEEDTRONIC_RUN__SEED": "5"},
        secrets_dir=no_secrets,
    )
    order = list(known_fields())
    keys = list(resolved.sources)
    assert keys == sorted(keys, key=order.index)
    assert resolved.sources["run.seed"] == "env:SPEEDTRONIC_RUN__SEED"


def test_load_and_from_dict_never_read_environment(monkeypatch) -> None:
    from speedtronic.config import SpeedtronicConfig, load_config

    monkeypatch.setenv("SPEEDTRONIC_RUN__MAX_STEPS", "7")
    monkeypatch.setenv("SPEEDTRONIC_FOO", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert load_config(SMOKE).run.max_steps == 200
    assert SpeedtronicConfig.from_dict({}).distributed.token is None


def test_aliases_are_normalised_once_per_load(tmp_path, monkeypatch, no_secrets) -> None:
    """issue 11: the file is canonicalised where it is read; the merge is built as canonical."""
    from speedtronic.config import layering, loading, schema

    calls: list[object] = []

    def counting(values):
        calls.append(values)
        return loading.canonicalize(values)

    monkeypatch.setattr(layering, "canonicalize", counting)
    monkeypatch.setattr(schema, "canonicalize", counting)
    path = tmp_path / "old.yaml"
    path.write_text("max_steps: 9\nhub:\n  inner_steps: 3\noptimizer: muon\n")
    environ = {"SPEEDTRONIC_RUN__SEED": "4", "SPEEDTRONIC_COMPILE": "{enabled: true}"}
    resolved = resolve_config(str(path), environ=environ, secrets_dir=no_secrets)
    assert len(calls) == 1
    config = resolved.config
    assert (config.run.max_steps, config.distributed.inner_steps) == (9, 3)
    assert (config.optimizer.name, config.run.seed, config.compile) == ("muon", 4, True)
    assert resolved.sources["compile"] == "env:SPEEDTRONIC_COMPILE"


def test_env_and_secrets_are_read_without_a_second_model(tmp_path) -> None:
    """issue 11: names map to fields by lookup; the section dataclasses are the one validator
    (issue 21: they are pydantic dataclasses now, so pydantic is expected; torch is not)."""
    secrets = _write_secrets(tmp_path / "s", hf_token="hf_from_file\n", run__seed="5\n")
    code = (
        "import sys\n"
        "from speedtronic.config import resolve_config\n"
        f"r = resolve_config({SMOKE!r}, environ={{'SPEEDTRONIC_OPTIMIZER__LR': '1e-3'}},"
        f" secrets_dir={secrets!r})\n"
        "assert (r.config.optimizer.lr, r.config.run.seed) == (1e-3, 5)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_secret_files_that_are_not_ours_or_not_text(tmp_path) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_text("hf_outside_the_directory\n")
    secrets = tmp_path / "s"
    _write_secrets(secrets, RUN__SEED="6\n")
    (secrets / "hf_token").symlink_to(outside)  # a link out of the directory: an error
    message = _resolve_error(secrets, "leads out of the secrets directory")  # (issue 31)
    assert str(secrets / "hf_token") in message and "hf_outside" not in message
    (secrets / "hf_token").unlink()
    (secrets / "not_a_field").symlink_to(outside)  # a name that is no field is not ours
    resolved = resolve_config({}, environ={}, secrets_dir=str(secrets))
    assert resolved.config.distributed.token is None
    assert resolved.sources == {"run.seed": "secret:RUN__SEED"}
    (secrets / "run__max_steps").write_bytes(b"\xff\xfe7\n")
    message = _resolve_error(secrets, "run__max_steps is not UTF-8 text")
    assert str(secrets / "run__max_steps") in message


def _resolve_error(secrets: Path, needle: str) -> str:
    with pytest.raises(ConfigError, match=needle) as caught:
        resolve_config({}, environ={}, secrets_dir=str(secrets))
    return str(caught.value)


@pytest.mark.parametrize("layer", ["file", "env", "secret", "cli"])
def test_a_bad_value_names_the_field_the_expectation_and_its_source(tmp_path, layer) -> None:
    """SPEC: a config error names the field's path, what was expected, the value and where it
    came from (the file's path, the env name, the secret file, --set)."""
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  max_steps: -1\n" if layer == "file" else "run:\n  name: x\n")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    if layer == "secret":
        (secrets / "run__max_steps").write_text("-1\n")
    environ = {"SPEEDTRONIC_RUN__MAX_STEPS": "-1"} if layer == "env" else {}
    overrides = ["run.max_steps=-1"] if layer == "cli" else []
    with pytest.raises(ConfigError) as caught:
        resolve_config(str(path), environ=environ, secrets_dir=secrets, overrides=overrides)
    origin = {
        "file": str(path),
        "env": "env:SPEEDTRONIC_RUN__MAX_STEPS",
        "secret": "secret:run__max_steps",
        "cli": "cli",
    }[layer]
    assert str(caught.value) == f"run.max_steps must be greater than 0, got int -1 (from {origin})"
