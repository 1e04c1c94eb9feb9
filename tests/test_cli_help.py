"""Each command's ``--help`` lists only the flags it reads (issue 29: ``export --help`` listed
``--max-steps`` and ``--resume``), and every flag it lists is accepted."""

from __future__ import annotations

import re

import pytest

from speedtronic.cli import main

CONFIG = {"--config", "--output-dir", "--set"}
EXPECTED = {
    "validate": CONFIG | {"--max-steps", "--device", "--resume", "--format", "--init-from"},
    "train": CONFIG | {"--max-steps", "--device", "--resume", "--overwrite", "--init-from"},
    "run": CONFIG | {"--max-steps", "--device", "--resume", "--overwrite", "--init-from"},
    "config show": CONFIG | {"--max-steps", "--device", "--sources", "--format"},
    "config schema": set(),
    "config docs": {"--write"},
    "eval": CONFIG | {"--device", "--checkpoint", "--global", "--format"},
    "sample": CONFIG
    | {"--device", "--checkpoint", "--global", "--prompt", "--max-new-tokens", "--temperature"}
    | {"--top-k", "--seed"},
    "export": CONFIG
    | {"--checkpoint", "--global", "--format", "--output", "--overwrite"}
    | {"--verify"},
    "push": CONFIG | {"--checkpoint", "--global", "--repo", "--private"},
    "prepare": {"--input", "--output", "--tokenizer", "--field", "--holdout", "--workers"}
    | {"--shard-tokens", "--utf8", "--overwrite", "--no-progress"},
    "plot": {"--output", "--each-run"},
}


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*command.split(), "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_help_lists_only_the_commands_flags(capsys, command) -> None:
    flags = set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", _help(capsys, command), re.M))
    assert flags - {"--help"} == EXPECTED[command]


@pytest.mark.parametrize("flag", ["--max-steps", "--resume", "--device"])
def test_export_refuses_the_flags_it_does_not_read(capsys, flag) -> None:
    argv = ["export", "--output", "x", flag] + (["1"] if flag != "--resume" else [])
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_every_command_is_covered(capsys) -> None:
    listed = set(re.findall(r"^    ([a-z]+)\s", _help(capsys, ""), re.M))
    assert listed == {c.split()[0] for c in EXPECTED}
    actions = set(re.findall(r"^    ([a-z]+)\s", _help(capsys, "config"), re.M))
    assert {f"config {a}" for a in actions} == {c for c in EXPECTED if c.startswith("config ")}
