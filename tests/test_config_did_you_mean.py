"""Typos get "did you mean" (issue 29): ``--set`` keys, and environment variables whose
``SPEEDTRONIC_`` prefix is a near miss (they would otherwise set nothing without a word)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from speedtronic.config import ConfigError, resolve_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "smoke.yaml")


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("optimzer.lr", "optimizer.lr"),  # a dropped letter in the section
        ("optimizer.lrr", "optimizer.lr"),  # ... in the field
        ("run.max_step", "run.max_steps"),
        ("run.lr", "optimizer.lr"),  # the right field in the wrong section
    ],
)
def test_an_unknown_set_key_names_the_field_it_most_likely_meant(key, meant, tmp_path):
    with pytest.raises(ConfigError) as caught:
        resolve_config(SMOKE, environ={}, secrets_dir=tmp_path, overrides=[f"{key}=0.001"])
    assert f"invalid override {key!r}: unknown configuration field" in str(caught.value)
    assert str(caught.value).endswith(f"(did you mean {meant}?)"), caught.value


def test_a_key_close_to_nothing_gets_no_guess(tmp_path):
    with pytest.raises(ConfigError) as caught:
        resolve_config(SMOKE, environ={}, secrets_dir=tmp_path, overrides=["totally.bogus=1"])
    assert "did you mean" not in str(caught.value)


@pytest.mark.parametrize(
    "name",
    [
        "SPEEDTONIC_RUN__MAX_STEPS",  # a dropped letter
        "SPEEDTRONICS_RUN__MAX_STEPS",  # an extra one
        "SPEED_TRONIC_RUN__MAX_STEPS",
        "SPEEDTRONICRUN__MAX_STEPS",  # no separator after the prefix
        "SPEEDTONIC_RUN_MAX_STEPS",  # and one _ between section and field
        "speedtonic_run__max_steps",  # any case, as the real prefix
    ],
)
def test_a_near_miss_prefix_before_a_field_is_an_error_naming_the_real_name(name, tmp_path):
    with pytest.raises(ConfigError) as caught:
        resolve_config(SMOKE, environ={name: "7"}, secrets_dir=tmp_path)
    message = str(caught.value)
    assert message.startswith(f"unknown environment variable {name}: its prefix is not")
    assert message.endswith("(did you mean SPEEDTRONIC_RUN__MAX_STEPS?)"), message


def test_one_underscore_between_section_and_field_is_an_error_too(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean SPEEDTRONIC_RUN__MAX_STEPS\?"):
        resolve_config(SMOKE, environ={"SPEEDTRONIC_RUN_MAX_STEPS": "7"}, secrets_dir=tmp_path)


@pytest.mark.parametrize(
    "name",
    ["SPEEDTEST_RUN__MAX_STEPS", "MAX_STEPS", "RUN__MAX_STEPS", "SPEEDTONIC_SOMETHING_ELSE"],
)
def test_other_programs_variables_are_left_alone(name, tmp_path):
    resolved = resolve_config(SMOKE, environ={name: "7"}, secrets_dir=tmp_path)
    assert resolved.config.run.max_steps == 200


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SPEEDTRONIC_")}
    env.update(PYTHONPATH=str(ROOT), SPEEDTONIC_RUN__MAX_STEPS="7")
    validate = [sys.executable, "-m", "speedtronic", "validate", "--config", SMOKE]
    done = subprocess.run(
        validate,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: unknown environment variable SPEEDTONIC_RUN__MAX_STEPS: its prefix is not "
        "SPEEDTRONIC_, so it sets nothing (did you mean SPEEDTRONIC_RUN__MAX_STEPS?)"
    ]
    env.pop("SPEEDTONIC_RUN__MAX_STEPS")
    done = subprocess.run(
        [*validate, "--set", "optimzer.lr=0.01"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().endswith("(did you mean optimizer.lr?)"), done.stderr
