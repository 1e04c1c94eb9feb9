"""issue 31 items 3 and 8: the token's value leaks through no derived form, and a secret file
that is not a regular file inside the secrets directory is never skipped without a word.

Item 3: with a token that is not shaped like a Hub token in the ``hf_token`` secret file, the
same value given to a choice field (which lowercases what it is given) never appears in the
error, in any case; ``logging.run_name`` (or any other field) holding it is refused before a
tracker makes a directory of it; the scrubber matches every form in any letter case.
Item 8: an ``hf_token`` that is a link out of the directory, a FIFO, ``/dev/zero`` or a socket
is a configuration error naming it (exit 2), and the FIFO never blocks the read.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest
from process_support import run_speedtronic

from speedtronic import entrypoint
from speedtronic.cli import main
from speedtronic.config import ConfigError, SpeedtronicConfig, resolve_config
from speedtronic.config.redaction import holds_secret, scrub

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
TOKEN = "Tok_S3cr3t-Mixed-Case-9f8e7d"  # no `hf_` prefix: no pattern would find it
CHOICE_FIELDS = [
    "distributed.sync",
    "distributed.delta_dtype",
    "distributed.global_dtype",
    "distributed.role",
    "distributed.mode",
    "optimizer.name",
    "scheduler.name",
    "logging.format",
    "logging.trackers",
]


def _secrets(tmp_path: Path, **files: str) -> Path:
    secrets = tmp_path / "secrets"
    secrets.mkdir(exist_ok=True)
    for name, text in files.items():
        (secrets / name).write_text(text)
        os.chmod(secrets / name, 0o600)
    return secrets


def _no_token(text: str) -> bool:
    return TOKEN.lower() not in text.lower()


# --------------------------------------------------------------------------- the scrubber
@pytest.mark.parametrize(
    "spelling",
    [
        TOKEN.lower(),
        TOKEN.upper(),
        TOKEN.swapcase(),
        repr(TOKEN.lower()),
        json.dumps(f"got str {TOKEN.lower()!r}"),
        f"/out/tensorboard/{TOKEN.lower()}/events",
    ],
)
def test_the_scrubber_matches_every_form_in_any_case(spelling) -> None:
    cleaned = scrub(f"error: {spelling} (from cli)", [TOKEN + "\n"])
    assert _no_token(cleaned) and "<redacted>" in cleaned, cleaned


def test_holds_secret_is_any_case_and_whole_for_short_secrets() -> None:
    assert holds_secret(f"  {TOKEN.upper()}\n", [TOKEN])
    assert holds_secret(f"/runs/{TOKEN.lower()}/tb", [TOKEN])
    assert not holds_secret("/runs/other", [TOKEN])
    assert holds_secret("ABCD", ["abcd"]) and not holds_secret("/tmp/abcd", ["abcd"])
    assert not holds_secret("yes", ["yes"])  # under 4 characters: never a match


# --------------------------------------------------------------------------- choice fields
@pytest.mark.parametrize("dotted", CHOICE_FIELDS)
def test_a_choice_field_given_the_token_never_echoes_it(tmp_path, monkeypatch, capsys, dotted):
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(_secrets(tmp_path, hf_token=TOKEN + "\n")))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for value in (TOKEN, f"[{TOKEN}]") if dotted == "logging.trackers" else (TOKEN,):
        code = main(["validate", "--config", SMOKE, "--set", f"{dotted}={value}"])
        err = capsys.readouterr().err
        assert code == 2 and dotted in err, err
        assert _no_token(err), err


def test_a_choice_from_a_secret_file_is_not_echoed(tmp_path) -> None:
    """Any secret-file value, not only the token: the choice keeps it marked as a secret."""
    secrets = _secrets(tmp_path, distributed__sync="Not-A-Sync-Mode-77\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(SMOKE, environ={}, secrets_dir=str(secrets))
    message = str(caught.value)
    assert message.startswith("distributed.sync must be") and "(from secret:" in message
    assert "not-a-sync-mode-77" not in message.lower()
    secrets = _secrets(tmp_path, distributed__sync="OVERLAPPED\n")
    resolved = resolve_config(SMOKE, environ={}, secrets_dir=str(secrets))
    assert resolved.config.distributed.sync == "overlapped"
    assert type(resolved.config.distributed.sync) is str


# --------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    ("dotted", "value"),
    [
        ("logging.run_name", TOKEN),
        ("logging.run_name", TOKEN.lower()),
        ("logging.project", f" {TOKEN.upper()} "),
        ("run.name", TOKEN),
        ("run.output_dir", f"runs/{TOKEN}"),
        ("distributed.node_id", TOKEN),
    ],
)
def test_a_field_holding_the_token_is_refused(tmp_path, dotted, value) -> None:
    secrets = _secrets(tmp_path, hf_token=TOKEN + "\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(SMOKE, environ={}, secrets_dir=str(secrets), overrides=[f"{dotted}={value}"])
    message = str(caught.value)
    assert message.startswith(f"{dotted} holds the value of distributed.token (not shown)")
    assert "(from cli)" in message and _no_token(message)


def test_the_tracker_refuses_a_run_name_that_is_the_token(tmp_path) -> None:
    """A config built without the layering, or a node id from HOSTNAME: the tracker still makes
    no directory (nor W&B run) named after the token."""
    pytest.importorskip("tensorboard")
    config = SpeedtronicConfig.from_dict(
        {
            "run": {"output_dir": str(tmp_path / "out")},
            "logging": {"trackers": ["tensorboard"]},
            "distributed": {"token": TOKEN},
        }
    )
    with pytest.raises(ConfigError, match="tracker run name holds the value of") as caught:
        entrypoint._trackers(config, TOKEN.lower())  # the node id
    assert _no_token(str(caught.value))
    config.logging.run_name, config.run.name = "fine", TOKEN.upper()
    with pytest.raises(ConfigError, match="tracker project holds the value of"):
        entrypoint._trackers(config, "node-1")
    assert not (tmp_path / "out").exists()


def test_train_with_the_token_as_run_name_makes_no_directory(tmp_path) -> None:
    """The reported case end to end: `speedtronic train` with the TensorBoard tracker and
    ``logging.run_name=<token>`` exits 2 and leaves no file or directory named after it."""
    pytest.importorskip("tensorboard")
    secrets = _secrets(tmp_path, hf_token=TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SPEEDTRONIC_SECRETS_DIR=str(secrets))
    argv = ["train", "--config", SMOKE, "--max-steps", "2", "--output-dir", str(tmp_path / "o")]
    argv += ["--set", "logging.trackers=[tensorboard]"]
    done = run_speedtronic(
        *argv, "--set", f"logging.run_name={TOKEN.lower()}", cwd=tmp_path, env=env, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "logging.run_name holds the value of distributed.token" in done.stderr
    assert _no_token(done.stdout + done.stderr)
    names = [str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")]
    assert all(_no_token(name) for name in names), names
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- item 8
def _hf_token_error(secrets: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_config({}, environ={}, secrets_dir=str(secrets))
    message = str(caught.value)
    assert f"secret file {secrets / 'hf_token'}" in message, message
    return message


def test_an_hf_token_link_out_of_the_directory_is_an_error(tmp_path) -> None:
    outside = tmp_path / "elsewhere"
    outside.write_text(TOKEN + "\n")
    secrets = _secrets(tmp_path)
    (secrets / "hf_token").symlink_to(outside)
    message = _hf_token_error(secrets)
    assert "leads out of the secrets directory" in message and _no_token(message)


def test_an_hf_token_fifo_is_an_error_and_never_blocks(tmp_path) -> None:
    secrets = _secrets(tmp_path)
    os.mkfifo(secrets / "hf_token")
    result: dict[str, object] = {}

    def resolve() -> None:
        try:
            resolve_config({}, environ={}, secrets_dir=str(secrets))
        except ConfigError as exc:
            result["error"] = str(exc)

    reader = threading.Thread(target=resolve, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # unblock the reader before failing (no writer would ever come)
        with open(os.open(secrets / "hf_token", os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        pytest.fail("reading a FIFO secret file blocked")
    assert f"secret file {secrets / 'hf_token'} is a FIFO" in str(result.get("error"))


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null"])
def test_an_hf_token_device_is_an_error(tmp_path, target) -> None:
    if not os.path.exists(target):
        pytest.skip(f"no {target}")
    secrets = _secrets(tmp_path)
    (secrets / "hf_token").symlink_to(target)
    message = _hf_token_error(secrets)
    assert target in message or "character device" in message


def test_a_device_inside_the_directory_is_named_as_such(tmp_path) -> None:
    secrets = _secrets(tmp_path)
    path = secrets / "hf_token"
    with socket.socket(socket.AF_UNIX) as server:
        try:
            server.bind(str(path))
        except OSError as exc:  # path too long for a unix socket on this machine
            pytest.skip(f"cannot bind a unix socket here: {exc}")
        assert "is a socket" in _hf_token_error(secrets)


def test_an_hf_token_link_inside_the_directory_is_read(tmp_path) -> None:
    secrets = _secrets(tmp_path, **{"real-token": TOKEN + "\n"})
    (secrets / "hf_token").symlink_to("real-token")
    resolved = resolve_config({}, environ={}, secrets_dir=str(secrets))
    assert resolved.config.distributed.token == TOKEN


def test_the_cli_exits_2_naming_the_file(tmp_path, monkeypatch, capsys) -> None:
    secrets = _secrets(tmp_path)
    os.mkfifo(secrets / "hf_token")
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(secrets))
    assert main(["validate", "--config", SMOKE]) == 2
    err = capsys.readouterr().err
    assert f"secret file {secrets / 'hf_token'} is a FIFO" in err
