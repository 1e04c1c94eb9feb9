"""Shared by the tests that drive the ``speedtronic`` command line in this process: a run's YAML
written from a test's base values and its changes, and the CLI run with its output captured."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from speedtronic.cli import main


def write_run_config(folder: Path, values: dict, **sections: dict) -> Path:
    """``values`` (a config as nested mappings) with the fields of each of ``sections`` set
    over that section, written as ``folder/run.yaml``; ``values`` itself is left as it was."""
    merged = {name: dict(v) if isinstance(v, dict) else v for name, v in values.items()}
    for name, fields in sections.items():
        merged.setdefault(name, {}).update(fields)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(merged))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``speedtronic argv`` run in this process: its exit code, stdout and stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err
