"""`speedtronic eval` on checkpoints, final/ directories and the DiLoCo global; `plot` evals."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_support import run_cli, write_run_config

from speedtronic.checkpoint import CheckpointError
from speedtronic.cli import main
from speedtronic.config import SpeedtronicConfig
from speedtronic.model import build_model
from speedtronic.train.evaluate import build_heldout, evaluate
from speedtronic.train.runtime import train_from_config
from speedtronic.train.scoring import score

MODEL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


def write_config(tmp_path: Path, **changes) -> Path:
    base = {
        "run": {"device": "cpu", "max_steps": 6, "output_dir": str(tmp_path / "run")},
        "model": dict(MODEL),
        "data": {"num_tokens": 256, "micro_batch_size": 4, "target_batch_size": 4},
        "optimizer": {"lr": 1e-2},
        "scheduler": {"warmup_steps": 1},
        "precision": "fp32",
        "checkpoint": {"every_steps": 3, "keep_last": 5},
        "logging": {"level": "WARNING", "json_file": str(tmp_path / "events.jsonl")},
        "eval": {"holdout": 0.1, "every_steps": 3, "tokens": 256, "batch_size": 8},
    }
    return write_run_config(tmp_path, base, **changes)


def eval_events(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "eval"]


@pytest.fixture
def trained(tmp_path):
    path = write_config(tmp_path)
    train_from_config(SpeedtronicConfig.from_yaml(path))
    return path


def test_eval_scores_the_newest_checkpoint_like_the_trainer_did(trained, tmp_path, capsys):
    code, out, err = run_cli(capsys, "eval", "--config", str(trained), "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"loss", "perplexity", "tokens", "step", "outer_step", "checkpoint"}
    assert result["checkpoint"].endswith("step_000000000006.pt")  # which file it scored
    last = eval_events(tmp_path)[-1]
    assert result["step"] == last["step"] == 6 and result["outer_step"] is None
    assert result["loss"] == pytest.approx(last["loss"], rel=1e-9)  # deterministic
    assert result["tokens"] == last["tokens"] == 256
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    code, out, _ = run_cli(capsys, "eval", "--config", str(trained))
    assert code == 0 and out.startswith("loss=") and " step=6 checkpoint=" in out  # no null
    assert "null" not in out and out.rstrip().endswith("step_000000000006.pt")
    assert "outer_step" not in out  # issue 29: absent (no DiLoCo), never printed as null


def test_eval_of_a_checkpoint_file_and_directory(trained, tmp_path, capsys):
    checkpoints = tmp_path / "run" / "checkpoints"
    first = checkpoints / "step_000000000003.pt"
    code, out, err = run_cli(
        capsys, "eval", "--config", str(trained), "--checkpoint", str(first), "--format", "json"
    )
    assert code == 0, err
    result = json.loads(out)
    at_three = next(e for e in eval_events(tmp_path) if e["step"] == 3)
    assert result["step"] == 3 and result["loss"] == pytest.approx(at_three["loss"], rel=1e-9)
    code, out, _ = run_cli(
        capsys,
        "eval",
        "--config",
        str(trained),
        "--checkpoint",
        str(checkpoints),
        "--format",
        "json",
    )
    assert code == 0 and json.loads(out)["step"] == 6


def test_eval_of_a_safetensors_final_directory(trained, tmp_path, capsys):
    from safetensors.torch import save_file

    config = SpeedtronicConfig.from_yaml(trained)
    torch.manual_seed(5)
    model = build_model(config.model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    final = tmp_path / "final"
    final.mkdir()
    save_file(state, str(final / "model.safetensors"))
    (final / "meta.json").write_text(json.dumps({"outer_step": 12, "step": 240}))
    code, out, err = run_cli(
        capsys, "eval", "--config", str(trained), "--checkpoint", str(final), "--format", "json"
    )
    assert code == 0, err
    result = json.loads(out)
    expected = evaluate(model, build_heldout(config), device="cpu")
    assert (result["step"], result["outer_step"]) == (240, 12)
    assert result["loss"] == pytest.approx(expected.loss, rel=1e-9)
    alone = tmp_path / "weights.safetensors"
    save_file(state, str(alone))
    code, out, _ = run_cli(
        capsys, "eval", "--config", str(trained), "--checkpoint", str(alone), "--format", "json"
    )
    assert code == 0 and json.loads(out)["outer_step"] is None


def test_eval_of_the_published_global(tmp_path, capsys):
    from speedtronic.diloco.coordinator import build_transport

    exchange = tmp_path / "exchange"
    path = write_config(tmp_path, distributed={"repo_id": f"file://{exchange}"})
    config = SpeedtronicConfig.from_yaml(path)
    code, _, err = run_cli(capsys, "eval", "--config", str(path), "--global")
    assert code == 2 and err.startswith("error: ") and "no global" in err
    torch.manual_seed(7)
    model = build_model(config.model)
    transport = build_transport(config.distributed)
    transport.publish_global(model.state_dict(), outer_step=4)
    code, out, err = run_cli(capsys, "eval", "--config", str(path), "--global", "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert result["outer_step"] == 4 and result["step"] is None
    expected = evaluate(model, build_heldout(config), device="cpu")
    assert result["loss"] == pytest.approx(expected.loss, rel=1e-9)


def _global_0_held(tmp_path, request_timeout: float):
    """A config on a volume exchange whose master published global 0's record, its weights
    file (sent after the record) held until the returned event is set; the model."""
    from speedtronic.diloco import exchange as T
    from speedtronic.diloco.coordinator import build_transport

    path = write_config(
        tmp_path,
        distributed={
            "repo_id": f"file://{tmp_path / 'exchange'}",
            "request_timeout": request_timeout,
        },
    )
    config = SpeedtronicConfig.from_yaml(path)
    torch.manual_seed(7)
    model = build_model(config.model)
    transport = build_transport(config.distributed)
    gate, original = threading.Event(), transport.commit

    def commit(additions, deletions=(), message="update", **how):
        if set(additions) == {T.GLOBAL_MODEL}:
            assert gate.wait(60)
        original(additions, deletions, message, **how)

    transport.commit = commit
    transport.publish_global(model.state_dict(), outer_step=0, run_id="r", weights_later=True)
    assert T.GLOBAL_MODEL not in transport.list_files()
    return config, model, gate, transport


def test_eval_of_global_0_waits_for_its_weights_sent_after_its_record(tmp_path, caplog):
    config, model, gate, transport = _global_0_held(tmp_path, request_timeout=60)
    result: dict = {}
    scoring = threading.Thread(target=lambda: result.update(score(config, use_global=True)))
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        scoring.start()
        deadline = time.monotonic() + 30
        while "the weights of global 0 are not in" not in caplog.text:
            assert time.monotonic() < deadline and scoring.is_alive()
            time.sleep(0.05)
        time.sleep(0.5)  # it keeps waiting: nothing is scored without the weights
        assert scoring.is_alive() and not result
        gate.set()
        scoring.join(60)
    assert transport.weights_upload.wait(10)
    assert result["outer_step"] == 0
    expected = evaluate(model, build_heldout(config), device="cpu")
    assert result["loss"] == pytest.approx(expected.loss, rel=1e-9)


def test_eval_of_a_global_whose_weights_never_come_says_so_after_request_timeout(tmp_path):
    config, _, gate, _ = _global_0_held(tmp_path, request_timeout=1)
    begun = time.monotonic()
    with pytest.raises(CheckpointError, match=r"cannot read the global .*latest\.safetensors"):
        score(config, use_global=True)
    assert 0.9 <= time.monotonic() - begun < 10
    gate.set()


def test_eval_bad_input_exits_2_with_one_line(trained, tmp_path, capsys):
    cases = [
        (["--set", "eval.holdout=0"], "no held-out data configured"),
        (["--checkpoint", str(tmp_path / "missing.pt")], "checkpoint not found"),
        (["--output-dir", str(tmp_path / "empty")], "no checkpoint in"),
        (["--set", "model.d_model=16"], "does not match the configured model"),
    ]
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    cases.append((["--checkpoint", str(corrupt)], "unreadable"))
    bad_safetensors = tmp_path / "bad.safetensors"
    bad_safetensors.write_bytes(b"\x00" * 16)
    cases.append((["--checkpoint", str(bad_safetensors)], "not a readable safetensors file"))
    for extra, message in cases:
        code, out, err = run_cli(capsys, "eval", "--config", str(trained), *extra)
        lines = err.strip().splitlines()
        assert code == 2 and out == "", (extra, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], extra
    with pytest.raises(SystemExit) as usage:  # argparse: the sources are exclusive
        main(["eval", "--config", str(trained), "--checkpoint", "x", "--global"])
    assert usage.value.code == 2


def test_plot_draws_local_and_global_eval_points(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from speedtronic.metrics.plot import plot_command, read_eval_points

    log = tmp_path / "events.jsonl"
    steps = [
        {"event": "train_step", "step": s, "loss": 5.0 - s / 10, "lr": 1e-3} for s in range(30)
    ]
    evals = [
        {"event": "eval", "step": 0, "loss": 4.9, "scope": "local"},
        {"event": "eval", "step": 10, "loss": 4.1, "scope": "local"},
        {"event": "eval", "step": 10, "loss": 4.0, "scope": "global", "outer_step": 1},
        {"event": "eval", "step": 20, "loss": 3.5, "scope": "global", "outer_step": 2},
        {"event": "eval", "step": 20, "loss": 3.6},  # no scope: local
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in steps + evals) + '{"torn": ')
    assert read_eval_points(log) == {
        "global": [(10, 4.0), (20, 3.5)],
        "local": [(0, 4.9), (10, 4.1), (20, 3.6)],
    }

    def red_pixels(path: Path) -> int:
        image = imread(str(path))[..., :3]  # tab:red is (0.84, 0.15, 0.16)
        return int(((image[..., 0] > 0.7) & (image[..., 1] < 0.3) & (image[..., 2] < 0.3)).sum())

    with_evals = Path(plot_command(str(log), str(tmp_path / "with.png")))
    plain_log = tmp_path / "plain.jsonl"
    plain_log.write_text("".join(json.dumps(r) + "\n" for r in steps))
    plain = Path(plot_command(str(plain_log), str(tmp_path / "plain.png")))
    assert red_pixels(with_evals) > 50 and red_pixels(plain) == 0
    # A pure aggregator logs only eval events: still a plot.
    only = tmp_path / "master.jsonl"
    only.write_text("".join(json.dumps(r) + "\n" for r in evals))
    assert Path(plot_command(str(only), str(tmp_path / "only.png"))).exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "train_start"}\n')
    with pytest.raises(ValueError, match="no train_step or eval records"):
        plot_command(str(empty), str(tmp_path / "e.png"))
