"""``speedtronic run`` without a config runs the embedded main job (issue 29): the DiLoCo
default shipped inside the package, byte for byte ``configs/diloco.yaml``; ``--config`` and
``SPEEDTRONIC_CONFIG`` still win, and the start-up log names the config used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from speedtronic.cli import main
from speedtronic.defaults import MAIN_JOB

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_")}
    env.pop("HF_TOKEN", None)
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        SPEEDTRONIC_SECRETS_DIR=str(tmp_path / "secrets"),
        # the shipped exchange folder is /tmp/speedtronic-exchange: keep this test's apart
        SPEEDTRONIC_DISTRIBUTED__REPO_ID=f"file://{tmp_path}/exchange",
        SPEEDTRONIC_METRICS__PORT="0",
    )
    env.update(extra)
    return env


def test_the_packaged_main_job_is_configs_diloco_yaml() -> None:
    """One definition in two places (the wheel needs it inside the package; compose and k8s
    mount configs/): an edit to one without the other fails here."""
    shipped = (REPO / "configs" / "diloco.yaml").read_bytes()
    assert MAIN_JOB.read_bytes() == shipped, (
        "speedtronic/defaults/diloco.yaml and configs/diloco.yaml differ; edit both"
    )


@pytest.mark.slow
def test_the_wheel_carries_the_main_job(tmp_path) -> None:
    """Built as the Dockerfile builds it: pyproject.toml, README.md and the package alone."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "speedtronic", source / "speedtronic", ignore=ignore)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("speedtronic-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = archive.read("speedtronic/defaults/diloco.yaml")
    assert packaged == (REPO / "configs" / "diloco.yaml").read_bytes()


@pytest.mark.slow
def test_run_without_a_config_runs_the_main_job(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", "run", "--max-steps", "20"],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "| config: " in line]
    assert f"from the embedded main job {MAIN_JOB}" in line
    assert "run diloco-local, 20 steps" in done.stdout
    assert "role=master" in done.stdout and "outer_step=1" in done.stdout  # a DiLoCo round
    assert (tmp_path / "runs" / "diloco" / "checkpoints").is_dir()  # configs/diloco.yaml's


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--config", "SPEEDTRONIC_CONFIG"])
def test_a_named_config_wins_over_the_main_job(tmp_path, how) -> None:
    argv = ["run", "--max-steps", "2", "--output-dir", str(tmp_path / "out")]
    env = _env(tmp_path)
    if how == "--config":
        argv += ["--config", str(SMOKE)]
    else:
        env["SPEEDTRONIC_CONFIG"] = str(SMOKE)
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "| config: " in line]
    assert f"from {SMOKE};" in line and "main job" not in line
    assert "run smoke, 2 steps" in done.stdout


@pytest.mark.parametrize("command", ["train", "validate", "config show"])
def test_other_commands_still_need_a_config(capsys, monkeypatch, tmp_path, command) -> None:
    monkeypatch.delenv("SPEEDTRONIC_CONFIG", raising=False)
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(tmp_path / "secrets"))
    assert main(command.split()) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: no configuration given") and "speedtronic run" in line
