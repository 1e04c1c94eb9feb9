"""Checkpoints and exports travel (issue 29, item 4): the tokenizer rides inside every
checkpoint, so ``eval``, ``sample`` and ``export --checkpoint X`` work from any directory with
no ``--set`` (also after the tokenizer file is gone); exported files share one mode; ``sample``
and transformers' ``generate`` on the export give the same greedy tokens for a prompt.

Before: the checkpoint stored the tokenizer as the relative path it was given, so every
command failed from another folder; ``model.safetensors`` was exported 0600 and the rest
0644; ``sample`` put the end-of-text token before the prompt and the exported tokenizer did
not, so the two decoded different continuations.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import yaml
from cli_support import run_cli, write_run_config
from tokenizer_fixtures import corpus_text, train_bpe

from speedtronic.checkpoint import CheckpointManager
from speedtronic.config import SpeedtronicConfig
from speedtronic.data.tokenizer import tokenizer_for
from speedtronic.model import build_model
from speedtronic.train.runtime import train_from_config
from speedtronic.train.sampling import generate, prompt_ids

transformers = pytest.importorskip("transformers")

MODEL = {"vocab_size": 320, "max_seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64}
PROMPT = "the quick brown"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run trained in ``<tmp>/a`` with relative paths (text, tokenizer, output)."""
    home = tmp_path_factory.mktemp("travel") / "a"
    train_bpe(home / "tok" / "tokenizer.json", vocab_size=300)
    (home / "train.txt").write_text(corpus_text(400))
    values = {
        "run": {"device": "cpu", "max_steps": 30, "output_dir": "run"},
        "model": MODEL,
        "data": {
            "text_path": "train.txt",
            "tokenizer": "tok/tokenizer.json",
            "micro_batch_size": 4,
            "target_batch_size": 4,
        },
        "optimizer": {"lr": 1e-2},
        "scheduler": {"warmup_steps": 2},
        "checkpoint": {"every_steps": 15},
        "eval": {"holdout": 0.1, "every_steps": 0, "tokens": 512},
        "logging": {"level": "WARNING"},
    }
    write_run_config(home, values)
    before = Path.cwd()
    os.chdir(home)
    try:
        train_from_config(SpeedtronicConfig.from_yaml("run.yaml"))
    finally:
        os.chdir(before)
    return home


def test_eval_sample_and_export_work_from_another_folder_without_the_tokenizer_file(
    trained, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("SPEEDTRONIC_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where the tokenizer is written back
    checkpoints = trained / "run" / "checkpoints"
    newest = checkpoints / "step_000000000030.pt"
    moved = trained / "tok_moved"
    shutil.move(trained / "tok", moved)  # the run's tokenizer file is gone
    try:
        elsewhere = tmp_path / "b"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        code, out, err = run_cli(capsys, "eval", "--checkpoint", str(checkpoints))
        assert code == 0, err
        assert "step=30" in out and str(newest) in out
        argv = ["sample", "--checkpoint", str(newest), "--prompt", "the", "--seed", "3"]
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, err
        assert out.startswith("the") and "(step 30)" in err
        old = os.umask(0o022)
        try:
            argv = ["export", "--checkpoint", str(newest), "-o", "hf"]
            code, out, err = run_cli(capsys, *argv)
        finally:
            os.umask(old)
        assert code == 0, err
        files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (elsewhere / "hf").iterdir()}
        assert set(files) >= {"model.safetensors", "tokenizer.json", "tokenizer_config.json"}
        assert set(files.values()) == {0o644}, files

        # a final/ folder whose config names the (now missing) relative tokenizer path finds
        # the tokenizer in the run's checkpoints beside it
        final = trained / "run" / "final"
        final.mkdir(exist_ok=True)
        from safetensors.torch import save_file

        state = CheckpointManager.load(newest)
        save_file({k: v.clone() for k, v in state["model"].items()}, final / "model.safetensors")
        relative = {
            **state["config"],
            "data": {**state["config"]["data"], "tokenizer": "tok/tokenizer.json"},
        }
        (final / "config.yaml").write_text(yaml.safe_dump(relative))
        code, out, err = run_cli(capsys, "sample", "--checkpoint", str(final), "--prompt", "the")
        assert code == 0, err
    finally:
        shutil.move(moved, trained / "tok")


def test_sample_and_transformers_generate_give_the_same_greedy_tokens(
    trained, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    newest = trained / "run" / "checkpoints" / "step_000000000030.pt"
    code, _, err = run_cli(
        capsys, "export", "--checkpoint", str(newest), "-o", str(tmp_path / "hf")
    )
    assert code == 0, err
    config_file = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config_file["bos_token"] == config_file["eos_token"] == "<|endoftext|>"

    state = CheckpointManager.load(newest)
    config = SpeedtronicConfig.from_dict(
        {**state["config"], "data": {**state["config"]["data"], "tokenizer": str(trained / "tok")}}
    )
    ours = tokenizer_for(config)
    ids = prompt_ids(ours, PROMPT)
    assert ids[0] == ours.eos_id  # a prompt starts a new document

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    encoded = hf_tokenizer(PROMPT, return_tensors="pt")
    assert encoded["input_ids"][0].tolist() == ids  # the export puts the same token first

    model = build_model(config.model)
    model.load_state_dict(state["model"])
    model.eval()
    new = generate(model, ids, max_new_tokens=12, block_size=32, temperature=0, eos_id=ours.eos_id)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        out = hf_model.generate(**encoded, do_sample=False, max_new_tokens=12, pad_token_id=0)
    theirs = out[0, len(ids) :].tolist()
    if ours.eos_id in theirs:
        theirs = theirs[: theirs.index(ours.eos_id)]
    assert new == theirs and len(new) > 0

    # the CLI's greedy text is transformers' decoded text
    argv = ["sample", "--checkpoint", str(newest), "--prompt", PROMPT, "--temperature", "0"]
    code, text, err = run_cli(capsys, *[*argv, "--max-new-tokens", "12"])
    assert code == 0, err
    assert text.rstrip("\n") == hf_tokenizer.decode(ids[1:] + theirs, skip_special_tokens=True)


def test_a_tokenizer_record_is_written_back_where_it_can_be(tmp_path, monkeypatch):
    from speedtronic.data.tokenizer import materialize_tokenizer, tokenizer_record

    bpe = train_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=300)
    record = tokenizer_record(str(bpe))
    assert tokenizer_record("bytes") is None and materialize_tokenizer(None) is None
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    folder = materialize_tokenizer(record)
    assert folder.parent == tmp_path / "home" / ".cache" / "speedtronic" / "tokenizers"
    assert (folder / "tokenizer.json").read_text() == bpe.read_text()
    assert materialize_tokenizer(record) == folder  # the same record, the same folder
    (tmp_path / "blocked").write_text("a file where the home folder should be")
    monkeypatch.setenv("HOME", str(tmp_path / "blocked"))
    elsewhere = materialize_tokenizer(record)  # a private temporary folder instead
    assert (elsewhere / "tokenizer.json").read_text() == bpe.read_text()
