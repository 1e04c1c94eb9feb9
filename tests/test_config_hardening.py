"""Hostile and careless config input (issue 12 rows 1, 5, 9, 10, 11): every bad input is a
``ConfigError`` at validation, one line naming the field, exit 2 from the CLI; never a secret
in the message, never an expanded alias bomb."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from speedtronic.cli import main
from speedtronic.config import ConfigError, SpeedtronicConfig, load_config, resolve_config
from speedtronic.config.schema import SECTION_CLASSES

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hf_HardeningTok3nAbcdefghijklmnopqrstu"  # token-shaped: hf_ + 34 letters/digits
ODD_TOKEN = "not-shaped/like a token_9f8e7d"  # a secret a pattern would never recognise


@pytest.fixture(autouse=True)
def _no_ambient_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(tmp_path / "no-secrets"))
    monkeypatch.chdir(tmp_path)


def _error(values) -> str:
    with pytest.raises(ConfigError) as info:
        SpeedtronicConfig.load(values)
    return str(info.value)


def _resolve_error(source=None, **kwargs) -> str:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as info:
        resolve_config(source if source is not None else {}, **kwargs)
    return str(info.value)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def _alias_bomb(levels: int = 8) -> str:
    """``levels`` nested anchors, each referenced nine times: 9**levels strings, ~280 bytes."""
    value = '&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
    names = "abcdefghijklmnop"
    for previous, current in itertools.pairwise(names[: levels + 1]):
        value = f"&{current} [{value}," + ",".join([f"*{previous}"] * 8) + "]"
    return f"run:\n  name: {value}\n"


# --------------------------------------------------------------------------- row 5: alias bomb


def test_alias_bomb_in_a_field_is_refused_before_it_is_built(tmp_path) -> None:
    text = _alias_bomb()
    assert len(text) < 400
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    started = time.perf_counter()
    message = _resolve_error(str(path))
    elapsed = time.perf_counter() - started
    assert "alias" in message and str(path) in message
    assert elapsed < 1.0, elapsed  # 9.5 s and 375 MB before the loader bounded documents


def test_alias_bomb_exits_2_fast_with_bounded_memory(tmp_path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(levels=9))  # 1.1 GB / MemoryError before
    # Peak RSS of this process's own address space (VmHWM). Not getrusage's ru_maxrss: Linux
    # carries the parent's high-water mark across fork/exec into it, so under a pytest process
    # that has grown past 300 MB the child would report the parent's peak, not its own.
    script = (
        "import re, sys, time\n"
        "from speedtronic.cli import main\n"
        "t = time.perf_counter(); code = main(['validate', '--config', sys.argv[1]])\n"
        "status = open('/proc/self/status').read()\n"
        "rss = re.search(r'VmHWM:\\s*(\\d+) kB', status).group(1)\n"
        "print(code, time.perf_counter() - t, rss, file=sys.stdout)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPEEDTRONIC_SECRETS_DIR": str(tmp_path / "s")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    code, seconds, rss_kb = done.stdout.split()
    assert int(code) == 2
    assert float(seconds) < 2.0 and int(rss_kb) < 300_000
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "alias" in lines[0], done.stderr


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("run:\n  name: &a [x, *a]\n", "alias refers to a node that contains it"),
        ("run:\n  name: " + "[" * 200 + "]" * 200 + "\n", "nesting deeper than 64"),
        ("run:\n  seed: 1\n  seed: 2\n", "duplicate key 'seed'"),
        ("run: {}\nrun: {}\n", "duplicate key 'run'"),
    ],
)
def test_yaml_documents_are_bounded(text, needle) -> None:
    assert needle in _error(text)


def test_merge_keys_are_not_duplicates() -> None:
    config = load_config("run:\n  <<: {max_steps: 3, seed: 1}\n  seed: 5\n")
    assert (config.run.max_steps, config.run.seed) == (3, 5)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"run": {"seed": 1, "seed": 2}}', "duplicate key 'seed'"),
        ('{"run": {"name": ' + "[" * 3000 + "]" * 3000 + "}}", "nesting deeper than 64"),
        ('{"run": {"name": ' + "[" * 100 + "]" * 100 + "}}", "nesting deeper than 64"),
        ('{"run": {"seed": ' + "7" * 5000 + "}}", "run.seed must be a 64-bit integer"),
    ],
)
def test_json_documents_are_bounded(tmp_path, text, needle) -> None:
    path = tmp_path / "c.json"
    path.write_text(text)
    assert needle in _error(str(path))


def test_an_alias_bomb_in_an_environment_value_is_refused() -> None:
    bomb = _alias_bomb().split("name: ", 1)[1]
    message = _resolve_error(environ={"SPEEDTRONIC_OPTIMIZER__BETAS": bomb})
    assert "optimizer.betas" in message and "alias" in message


# --------------------------------------------------------------------------- row 10: bad inputs


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("run:\n  name: " + "[" * 3000 + "]" * 3000 + "\n", "nesting deeper than 64"),
        ("run:\n  seed: " + "9" * 5000 + "\n", "run.seed must be a 64-bit integer"),
        ("run:\n  max_steps: " + "9" * 5000 + "\n", "run.max_steps must be a 64-bit integer"),
        ("run:\n  seed: 1000000000000000000000000000000\n", "run.seed must be"),
        ("run:\n  seed: -1\n", "run.seed must be greater than or equal to 0, got int -1"),
        (
            "data:\n  seed: 4294967296\n",
            "data.seed must be less than or equal to 4294967295, got int 4294967296",
        ),
        ('run:\n  output_dir: "runs\\0x"\n', "run.output_dir must not contain a NUL byte"),
        ('logging:\n  json_file: "a\\0.jsonl"\n', "logging.json_file must not contain a NUL"),
        ('checkpoint:\n  directory: "c\\0"\n', "checkpoint.directory must not contain a NUL"),
        ("run:\n  output_dir: " + "x" * 300 + "\n", "run.output_dir has a path segment longer"),
        ("distributed:\n  node_id: " + "n" * 300 + "\n", "at most 128 are allowed"),
    ],
)
def test_bad_inputs_exit_2_with_one_line_naming_the_field(capsys, tmp_path, text, needle) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, err = _cli(capsys, "validate", "--config", str(path))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert len(lines[0]) < 400


@pytest.mark.parametrize(
    ("setup", "values", "needle"),
    [
        # log paths, like checkpoint.directory, are under run.output_dir (default: runs)
        ("dir", {"logging": {"json_file": "events"}}, "logging.json_file: runs/events is a dir"),
        ("dir", {"logging": {"file": "events"}}, "logging.file: runs/events is a directory"),
        ("file", {"checkpoint": {"directory": "events"}}, "checkpoint.directory: runs/events"),
        ("file", {"run": {"output_dir": "events"}}, "run.output_dir: events is a file"),
        ("file", {"logging": {"json_file": "events/x.jsonl"}}, "logging.json_file: runs/events/x"),
        ("dir", {"data": {"token_path": "events"}}, "data.token_path: events is a directory"),
    ],
)
def test_unusable_paths_fail_at_validation(tmp_path, setup, values, needle) -> None:
    under_output_dir = "checkpoint" in values or "logging" in values
    target = tmp_path / ("runs/events" if under_output_dir else "events")
    target.parent.mkdir(parents=True, exist_ok=True)
    if setup == "dir":
        target.mkdir()
    else:
        target.write_text("x")
    assert needle in _error(values)


def test_a_node_id_longer_than_a_path_segment_is_one_rule_everywhere() -> None:
    from speedtronic.diloco.link import resolve_node_id

    long_id = "w" * 300
    assert "at most 128" in _error({"distributed": {"node_id": long_id}})
    assert "at most 128" in _resolve_error(environ={"SPEEDTRONIC_NODE_ID": long_id})
    with pytest.raises(ConfigError, match="at most 128"):
        resolve_node_id(None, {"HOSTNAME": long_id})
    with pytest.raises(ConfigError, match="path-safe"):
        resolve_node_id(None, {"HOSTNAME": "pod name"})
    assert resolve_node_id(None, {"HOSTNAME": "w" * 128}) == "w" * 128


def test_hf_token_secret_that_is_a_directory_is_an_error(tmp_path) -> None:
    secrets = tmp_path / "secrets"
    (secrets / "hf_token").mkdir(parents=True)
    message = _resolve_error(secrets_dir=str(secrets))
    assert f"secret {secrets / 'hf_token'} is a directory" in message


def test_an_unreadable_secret_names_the_file(tmp_path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "run__seed").symlink_to("run__seed")  # a loop: no process can read it
    message = _resolve_error(secrets_dir=str(secrets))
    assert f"cannot read secret file {secrets / 'run__seed'}" in message


def test_kubernetes_secret_volume_entries_are_not_ours(tmp_path) -> None:
    secrets = tmp_path / "secrets"
    (secrets / "..2024_01_01").mkdir(parents=True)
    (secrets / "..2024_01_01" / "hf_token").write_text(TOKEN + "\n")
    (secrets / "..data").symlink_to("..2024_01_01")
    (secrets / "hf_token").symlink_to("..data/hf_token")
    resolved = resolve_config({}, environ={}, secrets_dir=str(secrets))
    assert resolved.config.distributed.token == TOKEN


# --------------------------------------------------------------------------- row 11: ranges


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"data": {"num_workers": 10**18}}, "data.num_workers must be less than or equal to 256"),
        ({"model": {"rope_base": 0}}, "model.rope_base must be greater than 0"),
        ({"model": {"rope_base": -10000}}, "model.rope_base must be greater than 0"),
        (
            {"distributed": {"poll_interval": 1e10}},
            "distributed.poll_interval must be less than or equal to 86400",
        ),
        (
            {"distributed": {"round_timeout": 1e10}},
            "distributed.round_timeout must be less than or equal to",
        ),
        (
            {"distributed": {"retry_max": 1e10}},
            "distributed.retry_max must be less than or equal to 86400",
        ),
        (
            {"distributed": {"request_timeout": 1e12}},
            "distributed.request_timeout must be less than or equal to",
        ),
        (
            {"distributed": {"retry_attempts": 10**9}},
            "distributed.retry_attempts must be less than or equal to",
        ),
        (
            {"distributed": {"delta_upload_shutdown_timeout": 1e300}},
            "distributed.delta_upload_shutdown_timeout must be less than or equal to 3600",
        ),
        (
            {"metrics": {"stall_seconds": 1e300}},
            "metrics.stall_seconds must be less than or equal to",
        ),
        ({"eval": {"tokens": 10**15}}, "eval.tokens must be less than or equal to"),
        ({"data": {"num_tokens": 10**12}}, "data.num_tokens must be less than or equal to"),
        (
            {"checkpoint": {"keep_last": 10**12}},
            "checkpoint.keep_last must be less than or equal to",
        ),
        ({"model": {"n_layer": 10**6}}, "model.n_layer must be less than or equal to 1024"),
    ],
)
def test_numeric_fields_have_upper_bounds(values, needle) -> None:
    assert needle in _error(values)


def _numeric_fields() -> list[str]:
    """Every section field whose type is a number (``int``/``float``, nullable or not)."""

    def kinds(annotation) -> set:
        members = typing.get_args(annotation) if typing.get_origin(annotation) else ()
        plain = [
            typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m
            for m in members or (annotation,)
        ]
        return set(plain) - {type(None)}

    return [
        f"{section}.{name}"
        for section, cls in SECTION_CLASSES.items()
        for name, info in cls.__pydantic_fields__.items()
        if kinds(info.annotation) in ({int}, {float})
    ]


def test_numeric_fields_are_found() -> None:
    found = _numeric_fields()
    assert len(found) > 40 and "optimizer.lr" in found and "run.log_every" in found


@pytest.mark.parametrize("dotted", _numeric_fields())
def test_every_numeric_field_refuses_absurd_values(dotted) -> None:
    """issue 21: optimizer.lr is bounded too (1e300 validated and gave NaN at step 2)."""
    section, name = dotted.split(".")
    for absurd in (10**15, -(10**15)):
        message = _error({section: {name: absurd}})
        legacy = "outer learning rate/momentum"  # a 2.0.0 text that names both fields
        assert dotted in message or name in message or legacy in message, (dotted, message)


def test_poll_interval_is_capped_below_what_event_wait_accepts() -> None:
    import threading

    from speedtronic.config.ops_sections import DAY, WEEK

    assert max(DAY, WEEK) < threading.TIMEOUT_MAX
    config = SpeedtronicConfig.from_dict({"distributed": {"poll_interval": DAY}})
    threading.Event().wait(0 * config.distributed.poll_interval)  # accepted values are waitable


# --------------------------------------------------------------------------- rows 1 and 9: tokens


@pytest.mark.parametrize("pad", ["\n", "\r\n", "\t", " \n", "\n\n"])
def test_token_whitespace_is_stripped_from_every_source(tmp_path, pad) -> None:
    env = resolve_config({}, environ={"HF_TOKEN": TOKEN + pad})
    assert env.config.distributed.token == TOKEN
    named = resolve_config({}, environ={"SPEEDTRONIC_DISTRIBUTED__TOKEN": pad + TOKEN + pad})
    assert named.config.distributed.token == TOKEN
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "hf_token").write_bytes((TOKEN + pad).encode())
    secret = resolve_config({}, environ={}, secrets_dir=str(secrets))
    assert secret.config.distributed.token == TOKEN
    from_yaml = load_config({"distributed": {"token": TOKEN + pad}})
    assert from_yaml.distributed.token == TOKEN


def test_token_with_inner_whitespace_is_refused_without_showing_it() -> None:
    message = _resolve_error(environ={"HF_TOKEN": "hf_abc\ndef_ghijk"})
    assert message.startswith("distributed.token contains whitespace")
    assert "hf_abc" not in message and "def_ghijk" not in message


@pytest.mark.parametrize("secret", [TOKEN, ODD_TOKEN])
@pytest.mark.parametrize("field", ["run__seed", "distributed__node_id", "optimizer__betas"])
def test_a_secret_file_in_the_wrong_field_is_never_printed(tmp_path, secret, field) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / field).write_text(secret + "\n")
    message = _resolve_error(secrets_dir=str(secrets))
    assert field.replace("__", ".") in message
    assert secret not in message and secret[:12] not in message


def test_a_token_in_the_wrong_field_is_never_printed_from_env_or_yaml(tmp_path) -> None:
    for environ in ({"SPEEDTRONIC_RUN__SEED": TOKEN}, {"SPEEDTRONIC_RUN__SEED": f"[{TOKEN}]"}):
        message = _resolve_error(environ=environ)
        assert "run.seed" in message and TOKEN[:12] not in message
    message = _resolve_error({"run": {"seed": ODD_TOKEN}}, environ={"HF_TOKEN": ODD_TOKEN})
    assert "run.seed" in message and ODD_TOKEN not in message
    path = tmp_path / "c.yaml"
    path.write_text(f"run:\n  max_steps: {TOKEN}\n")
    message = _resolve_error(str(path))
    assert "run.max_steps" in message and TOKEN[:12] not in message


def test_token_through_set_is_refused(capsys) -> None:
    smoke = str(REPO / "configs" / "smoke.yaml")
    code, err = _cli(capsys, "validate", "--config", smoke, "--set", f"distributed.token={TOKEN}")
    assert code == 2
    assert "HF_TOKEN" in err and "hf_token secret file" in err
    assert TOKEN not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="cannot be set with --set"):
        resolve_config({}, environ={}, overrides={"distributed.token": "x"})
