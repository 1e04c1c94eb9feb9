"""The ``speedtronic`` CLI: commands, overrides, exit codes and the single stderr line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from cli_support import run_cli
from process_support import run_speedtronic

from speedtronic.cli import main
from speedtronic.config import ConfigError, ResolvedConfig, SpeedtronicConfig, load_config

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")


@pytest.fixture(autouse=True)
def _isolated_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(tmp_path / "secrets"))


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


# --------------------------------------------------------------------------- validate
def test_config_show_prints_the_yaml(capsys) -> None:
    # issue 29: the YAML moved from validate (a dry run with a verdict) to config show
    code, out, err = run_cli(capsys, "config", "show", "--config", SMOKE)
    assert code == 0 and err == ""
    assert yaml.safe_load(out) == load_config(SMOKE).to_dict(redact_secrets=True)


def test_validate_ends_with_a_verdict(capsys) -> None:
    code, out, err = run_cli(capsys, "validate", "--config", SMOKE)
    assert code == 0 and err == ""
    assert out.splitlines()[-1] == (
        "config OK: 66,880 parameters, 200 steps, data synthetic markov (2048 samples), "
        "exchange none"
    )
    assert "name: smoke" not in out  # no YAML (issue 29: 146 lines of it before)


def test_validate_json(capsys) -> None:
    code, out, _ = run_cli(capsys, "validate", "--config", SMOKE, "--format", "json")
    assert code == 0
    payload = json.loads(out)
    assert payload["ok"] is True
    assert (payload["parameters"], payload["steps"]) == (66880, 200)
    assert payload["warnings"] == [] and payload["files"] == []


def test_validate_redacts_token(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_cli_secret")
    path = tmp_path / "tok.yaml"
    path.write_text("distributed:\n  token: hf_yaml_secret\n")
    for source in (SMOKE, str(path)):
        for argv in (("validate",), ("config", "show")):
            for fmt in ("json", "text" if argv == ("validate",) else "yaml"):
                code, out, err = run_cli(capsys, *argv, "--config", source, "--format", fmt)
                assert code == 0
                assert "hf_cli_secret" not in out + err
                assert "hf_yaml_secret" not in out + err
                if argv == ("config", "show"):
                    assert "<redacted>" in out


def test_token_in_yaml_warns_on_stderr(capsys, tmp_path) -> None:
    path = tmp_path / "tok.yaml"
    path.write_text("distributed:\n  token: hf_yaml_secret\n")
    code, _, err = run_cli(capsys, "validate", "--config", str(path))
    assert code == 0
    assert "warning:" in err and "token" in err
    assert "hf_yaml_secret" not in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("model:\n  n_layer: many\n", "error: model.n_layer must be an integer"),
        ("model:\n  n_layer: 0\n", "error: model.n_layer must be greater than 0, got int 0 (from "),
        ("model:\n  bogus: 1\n", "error: model: unknown configuration keys: bogus"),
        ("run:\n  max_steps: null\n", "error: run.max_steps must be an integer, got null"),
        ("checkpoint:\n  enabled: maybe\n", "error: checkpoint.enabled must be a boolean"),
        ("model:\n  n_layer: [1,\n", "invalid YAML at line"),
        ("- a\n- b\n", "error: configuration root must be a mapping"),
    ],
)
def test_bad_config_exits_2_with_one_line(capsys, tmp_path, content, needle) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    code, out, err = run_cli(capsys, "validate", "--config", str(path))
    assert code == 2 and out == ""
    assert needle in _one_error_line(err)


def test_missing_config_file(capsys, tmp_path) -> None:
    code, _, err = run_cli(capsys, "validate", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "config file not found" in _one_error_line(err)


def test_no_config_given(capsys) -> None:
    code, _, err = run_cli(capsys, "validate")
    assert code == 2
    assert "SPEEDTRONIC_CONFIG" in _one_error_line(err)


def test_config_from_environment(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPEEDTRONIC_CONFIG", SMOKE)
    code, out, _ = run_cli(capsys, "validate")
    assert code == 0 and "200 steps" in out.splitlines()[-1]


def test_unknown_env_var(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPEEDTRONIC_FOO", "1")
    code, _, err = run_cli(capsys, "validate", "--config", SMOKE)
    assert code == 2
    assert "SPEEDTRONIC_FOO" in _one_error_line(err)


# --------------------------------------------------------------------------- config show
def test_config_show_sources_json(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPEEDTRONIC_RUN__MAX_STEPS", "7")
    monkeypatch.setenv("HF_TOKEN", "hf_show_secret")
    argv = ["config", "show", "--config", SMOKE, "--sources", "--format", "json"]
    code, out, _ = run_cli(capsys, *argv, "--set", "optimizer.lr=1e-3")
    assert code == 0
    payload = json.loads(out)
    assert set(payload) == {"config", "sources"}
    assert payload["config"]["run"]["max_steps"] == 7
    assert payload["config"]["scheduler"]["max_steps"] == 7
    assert payload["config"]["distributed"]["token"] == "<redacted>"
    assert payload["sources"]["run.max_steps"] == "env:SPEEDTRONIC_RUN__MAX_STEPS"
    assert payload["sources"]["distributed.token"] == "env:HF_TOKEN"
    assert payload["sources"]["optimizer.lr"] == "cli"
    assert payload["sources"]["model.n_layer"] == "file"
    assert "hf_show_secret" not in out


def test_config_show_yaml(capsys) -> None:
    code, out, _ = run_cli(capsys, "config", "show", "--config", SMOKE)
    assert code == 0
    assert yaml.safe_load(out) == load_config(SMOKE).to_dict(redact_secrets=True)
    code, out, _ = run_cli(capsys, "config", "show", "--config", SMOKE, "--sources")
    payload = yaml.safe_load(out)
    assert payload["sources"]["run.name"] == "file"


def test_global_overrides(capsys, tmp_path) -> None:
    argv = [
        "config",
        "show",
        "--config",
        SMOKE,
        "--sources",
        "--format",
        "json",
        "--max-steps",
        "12",
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--set",
        "model.n_layer=3",
        "--set",
        "compile=true",
    ]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    payload = json.loads(out)
    config, sources = payload["config"], payload["sources"]
    assert (config["run"]["max_steps"], config["scheduler"]["max_steps"]) == (12, 12)
    assert config["run"]["output_dir"] == str(tmp_path / "out")
    assert config["run"]["device"] == "cpu"
    assert (config["model"]["n_layer"], config["compile"]) == (3, True)
    for key in ("run.max_steps", "run.output_dir", "run.device", "model.n_layer", "compile"):
        assert sources[key] == "cli"


def test_max_steps_beats_data_max_steps(capsys, tmp_path) -> None:
    path = tmp_path / "data.yaml"
    path.write_text("max_steps: 10\ndata:\n  max_steps: 50\n")
    argv = ["config", "show", "--config", str(path), "--max-steps", "5", "--format", "json"]
    code, out, _ = run_cli(capsys, *argv)
    config = json.loads(out)
    assert code == 0
    assert (config["run"]["max_steps"], config["data"]["max_steps"]) == (5, 5)
    assert config["scheduler"]["max_steps"] == 5


def test_bad_override(capsys) -> None:
    code, _, err = run_cli(capsys, "validate", "--config", SMOKE, "--set", "run.nope=1")
    assert code == 2 and "run.nope" in _one_error_line(err)
    code, _, err = run_cli(capsys, "validate", "--config", SMOKE, "--max-steps", "0")
    assert code == 2 and "run.max_steps must be greater than 0" in _one_error_line(err)


# --------------------------------------------------------------------------- train / run / plot
def _fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _fake_launch(monkeypatch, launch) -> None:
    """``speedtronic.entrypoint`` replaced by a module whose ``launch`` is ``launch``."""
    _fake_module(monkeypatch, "speedtronic.entrypoint", launch=launch)


def _recording_launch(monkeypatch, exit_code: int) -> dict:
    """A fake ``launch`` that records what it was called with (in the dict returned) and
    reports a 4-step run that ends with ``exit_code``."""
    seen: dict = {}

    def launch(resolved, *, command, resume, progress, argv):
        seen.update(resolved=resolved, command=command, resume=resume, progress=progress)
        seen["argv"] = argv
        result = types.SimpleNamespace(
            steps=4, samples=8, tokens=256, final_loss=1.5, stopped_reason=None
        )
        return types.SimpleNamespace(exit_code=exit_code, result=result)

    _fake_launch(monkeypatch, launch)
    return seen


def test_train_delegates(capsys, monkeypatch) -> None:
    calls = _recording_launch(monkeypatch, exit_code=0)
    code, out, _ = run_cli(capsys, "train", "--config", SMOKE, "--resume", "--max-steps", "3")
    assert code == 0
    assert out.strip() == "completed steps=4 samples=8 tokens=256 loss=1.5"
    assert isinstance(calls["resolved"], ResolvedConfig)
    config = calls["resolved"].config
    assert isinstance(config, SpeedtronicConfig)
    assert config.run.max_steps == 3
    assert config.scheduler.max_steps == 3
    assert calls["resolved"].sources["run.max_steps"] == "cli"
    assert calls["command"] == "train"
    assert calls["resume"] is True and calls["progress"] is None
    # what the agent runs once per rank when run.nproc_per_node > 1
    assert calls["argv"] == ["train", "--config", SMOKE, "--resume", "--max-steps", "3"]


def test_train_after_a_failed_graceful_stop_prints_no_completed_line(capsys, monkeypatch) -> None:
    _fake_launch(
        monkeypatch, lambda resolved, **kwargs: types.SimpleNamespace(exit_code=143, result=None)
    )
    code, out, _ = run_cli(capsys, "train", "--config", SMOKE)
    assert code == 143 and "completed" not in out


@pytest.mark.parametrize(
    ("exc", "code", "needle"),
    [
        (RuntimeError("boom\nsecond line"), 1, "error: RuntimeError: boom second line"),
        (ConfigError("data.text_path: file not found: /x"), 2, "error: data.text_path"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
    ],
)
def test_train_failures(capsys, monkeypatch, exc, code, needle) -> None:
    def launch(resolved, **kwargs):
        raise exc

    _fake_launch(monkeypatch, launch)
    result, _, err = run_cli(capsys, "train", "--config", SMOKE)
    assert result == code
    assert _one_error_line(err) == needle or _one_error_line(err).startswith(needle)


def test_errors_never_show_the_token(capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_leaky_token")

    def launch(resolved, **kwargs):
        raise RuntimeError(f"upload failed with {resolved.config.distributed.token}")

    _fake_launch(monkeypatch, launch)
    code, _, err = run_cli(capsys, "train", "--config", SMOKE)
    assert code == 1
    assert "hf_leaky_token" not in err and "<redacted>" in err


def test_errors_never_show_a_secret_file_token(capsys, monkeypatch, tmp_path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "hf_token").write_text("hf_file_token_value\n")
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(secrets))

    def launch(resolved, **kwargs):
        raise OSError(f"bad credentials {resolved.config.distributed.token}")

    _fake_launch(monkeypatch, launch)
    code, _, err = run_cli(capsys, "train", "--config", SMOKE)
    assert code == 1
    assert "hf_file_token_value" not in err and "<redacted>" in err


def test_run_delegates(capsys, monkeypatch) -> None:
    seen = _recording_launch(monkeypatch, exit_code=3)
    monkeypatch.setenv("SPEEDTRONIC_RUN__SEED", "9")
    code, out, _ = run_cli(capsys, "run", "--config", SMOKE)
    assert code == 3
    assert isinstance(seen["resolved"], ResolvedConfig)
    assert seen["resolved"].sources["run.seed"] == "env:SPEEDTRONIC_RUN__SEED"
    assert seen["command"] == "run" and seen["progress"] is False
    assert seen["resume"] is False and seen["argv"] == ["run", "--config", SMOKE]
    assert out == ""  # only `train` prints a completed line


def test_plot_delegates(capsys, monkeypatch, tmp_path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text("{}\n")

    def plot_command(source, output, each_run=False):
        seen["each_run"] = each_run
        return output

    seen: dict = {}

    pytest.importorskip("speedtronic.metrics")
    _fake_module(monkeypatch, "speedtronic.metrics.plot", plot_command=plot_command)
    code, out, _ = run_cli(capsys, "plot", str(events))
    assert code == 0 and out.strip() == str(tmp_path / "events.png")
    assert seen["each_run"] is False
    code, out, _ = run_cli(capsys, "plot", str(events), "-o", str(tmp_path / "x.png"), "--each-run")
    assert out.strip() == str(tmp_path / "x.png") and seen["each_run"] is True
    code, _, err = run_cli(capsys, "plot", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "not found" in _one_error_line(err)


def test_usage_errors_raise_system_exit_2(capsys) -> None:
    for argv in ([], ["validate", "--format", "xml"], ["bogus"], ["train", "--max-steps", "x"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


# --------------------------------------------------------------------------- real processes
def _subprocess(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_")}
    base.pop("HF_TOKEN", None)
    base["SPEEDTRONIC_SECRETS_DIR"] = "/nonexistent-speedtronic-secrets"
    base.update(env or {})
    return run_speedtronic(*argv, cwd=REPO, env=base, timeout=120)


def test_subprocess_done_when_env_max_steps() -> None:
    result = _subprocess(
        "config", "show", "--config", "configs/smoke.yaml", "--sources",
        env={"SPEEDTRONIC_RUN__MAX_STEPS": "7"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = yaml.safe_load(result.stdout)
    assert payload["config"]["run"]["max_steps"] == 7
    assert payload["config"]["scheduler"]["max_steps"] == 7
    assert payload["sources"]["run.max_steps"] == "env:SPEEDTRONIC_RUN__MAX_STEPS"


def test_subprocess_bad_config_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lr: fast\n")
    result = _subprocess("validate", "--config", str(bad))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: optimizer.lr must be a number, got str 'fast' (from {bad})"
    ]


def test_subprocess_malformed_yaml(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: x\n   max_steps: 3\n")
    result = _subprocess("validate", "--config", str(bad))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "line 3" in line and "column" in line and "Traceback" not in result.stderr


def test_subprocess_config_show_does_not_import_torch() -> None:
    # validate imports torch since issue 29 (it opens the data and builds the model on the
    # meta device, as train does); config show and every config error stay torch-free
    code = (
        "import sys; from speedtronic.cli import main; rc = main(['config', 'show', '--config', "
        "'configs/smoke.yaml']); assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_")}
    env["SPEEDTRONIC_SECRETS_DIR"] = "/nonexistent-speedtronic-secrets"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_subprocess_train_smoke(tmp_path) -> None:
    """The real thing end to end."""
    out = tmp_path / "run"
    result = _subprocess(
        "train", "--config", "configs/smoke.yaml", "--output-dir", str(out), "--max-steps", "4",
        "--device", "cpu", "--set", f"logging.json_file={out / 'events.jsonl'}",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("completed steps=4 ")
