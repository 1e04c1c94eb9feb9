"""Continuing from your own export (issue 39, item 6), walked as a new user walks it: prepare
token shards with a 1,024-id tokenizer, train, export, then ``train --init-from`` the export on
the same shards, with the config's ``data.tokenizer`` kept and with it left out. Small sizes,
in-process CLI calls from the user's folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from tokenizer_fixtures import train_bpe, word_level

from speedtronic.cli import main
from speedtronic.config import ConfigError
from speedtronic.config.tokenizer_file import describe_tokenizer
from speedtronic.data.shards import open_prepared

pytest.importorskip("transformers")

RUN = {
    "run": {"max_steps": 4, "output_dir": "runs/first", "device": "cpu"},
    "model": {"vocab_size": 1024, "max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32},
    "data": {
        "token_path": "tokens/",
        "tokenizer": "tokenizer.json",
        "micro_batch_size": 2,
        "target_batch_size": 2,
    },
    "scheduler": {"warmup_steps": 1},
    "eval": {"token_path": "tokens/", "every_steps": 2, "tokens": 128},
    "logging": {"level": "WARNING"},
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The user's folder after prepare, train and export (1,024 token ids: above the
    default model.vocab_size of 512)."""
    root = tmp_path_factory.mktemp("continue")
    word_level(root / "tokenizer.json", 1024)
    texts = root / "my-texts"
    texts.mkdir()
    rng = random.Random(0)
    for i in range(6):
        words = " ".join(f"w{rng.randrange(1000)}" for _ in range(300))
        (texts / f"d{i}.txt").write_text(words)
    (root / "run.yaml").write_text(yaml.safe_dump(RUN))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        prepare = ["prepare", "--tokenizer", "tokenizer.json", "--input", "my-texts/"]
        assert main([*prepare, "--output", "tokens/", "--holdout", "0.2", "--no-progress"]) == 0
        assert main(["train", "--config", "run.yaml"]) == 0
        assert main(["export", "--config", "run.yaml", "--format", "hf", "-o", "model-hf"]) == 0
    assert (root / "model-hf" / "tokenizer.json").read_bytes() != (
        root / "tokenizer.json"
    ).read_bytes()  # the export rewrote it (its post-processor), same vocabulary
    return root


def _continued(root: Path, name: str, **data: object) -> Path:
    """A second config: the export as the start, the same shards, nothing about the shape."""
    values = {
        **RUN,
        "run": {**RUN["run"], "output_dir": f"runs/{name}"},
        "model": {"init_from": "model-hf"},
        "data": {**RUN["data"], **data},
    }
    values["data"] = {k: v for k, v in values["data"].items() if v is not None}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("tokenizer", ["tokenizer.json", None], ids=["kept", "left-out"])
def test_train_export_then_init_from_the_export_on_the_same_shards(
    exported, monkeypatch, capsys, tokenizer
) -> None:
    monkeypatch.chdir(exported)
    name = f"more-{'kept' if tokenizer else 'default'}"
    config = _continued(exported, name, tokenizer=tokenizer).name
    assert main(["config", "show", "--config", config]) == 0, capsys.readouterr().err
    assert main(["validate", "--config", config]) == 0, capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out
    assert main(["train", "--config", config]) == 0, capsys.readouterr().err
    assert "completed steps=4" in capsys.readouterr().out
    assert list((exported / "runs" / name / "checkpoints").glob("*.pt"))


def test_validate_takes_init_from_on_the_command_line(exported, monkeypatch, capsys) -> None:
    monkeypatch.chdir(exported)
    argv = ["validate", "--config", "run.yaml", "--output-dir", "runs/v", "--init-from", "model-hf"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out


def test_a_longer_block_size_than_the_export_is_named(exported, monkeypatch, capsys) -> None:
    monkeypatch.chdir(exported)
    config = _continued(exported, "long", block_size=64).name
    assert main(["validate", "--config", config]) == 2
    assert "data.block_size is 64 but model.init_from model-hf has max_position_embeddings " in (
        capsys.readouterr().err
    )


def test_shards_are_matched_by_what_the_tokenizer_encodes(exported, tmp_path) -> None:
    ours = describe_tokenizer(str(exported / "tokenizer.json"))
    export = describe_tokenizer(str(exported / "model-hf"))
    assert ours.sha256 != export.sha256 and ours.encoding == export.encoding
    tokens = exported / "tokens"
    assert open_prepared(tokens, "train", "data.token_path", tokenizer_marks=export.encoding)
    other = describe_tokenizer(str(word_level(tmp_path / "other.json", 1024, eos="</s>")))
    bpe = describe_tokenizer(str(train_bpe(tmp_path / "bpe.json", vocab_size=300)))
    for stranger in (other, bpe):  # another end-of-text token, another vocabulary
        with pytest.raises(ConfigError, match=r"was tokenized with 'tokenizer\.json'"):
            open_prepared(tokens, "train", "data.token_path",
                          tokenizer_marks=(stranger.sha256, stranger.encoding))  # fmt: skip
    # A folder prepared before the digest was recorded: read from the tokenizer file it names.
    old = tmp_path / "old-tokens"
    old.mkdir()
    meta = json.loads((tokens / "meta.json").read_text())
    del meta["tokenizer"]["encoding"]
    for entry in meta["shards"]["train"]:
        (old / entry["file"]).write_bytes((tokens / entry["file"]).read_bytes())
    (old / "meta.json").write_text(json.dumps(meta))
    assert open_prepared(old, "train", "data.token_path", tokenizer_marks=[export.encoding])
