# ruff: noqa: F811  (pytest fixtures imported from hub_emulator_fixtures)
"""``data.tokenizer``: bytes or a tokenizer.json (path, folder, Hub id), validated against the
model vocabulary, separating documents with its end-of-text token in streaming and eval."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hub_emulator_fixtures import TEST_TOKEN, hub_emulator  # noqa: F401
from process_support import run_speedtronic
from tokenizer_fixtures import corpus_text, train_bpe, vocab_of, word_level

from speedtronic.cli import main
from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.data import CharTokenizer, HFTokenizer, load_tokenizer
from speedtronic.data.datasets import TextFileTokenDataset
from speedtronic.train.evaluate import build_heldout

REPO = Path(__file__).resolve().parents[1]
MODEL = {"vocab_size": 512, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=300)


def config(**data) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict({"model": dict(MODEL), "data": data})


def test_default_is_bytes_and_stays_bytes():
    assert SpeedtronicConfig().data.tokenizer == "bytes"
    assert config(tokenizer="BYTES").data.tokenizer == "bytes"
    assert isinstance(load_tokenizer("bytes", vocab_size=300), CharTokenizer)


def test_a_tokenizer_json_path_or_folder_validates_and_loads(bpe):
    for spec in (str(bpe), str(bpe.parent)):
        cfg = config(tokenizer=spec)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        assert isinstance(tokenizer, HFTokenizer)
        assert tokenizer.vocab_size == vocab_of(bpe) == 300
        assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_id == 0
        ids = tokenizer.encode("the quick brown fox")
        assert tokenizer.decode(ids) == "the quick brown fox"
        assert tokenizer.eos_id not in ids  # no special tokens added by encode


def test_vocabulary_larger_than_the_model_is_refused_naming_both_numbers(tmp_path):
    big = word_level(tmp_path / "big.json", 1000)
    with pytest.raises(ConfigError) as info:
        config(tokenizer=str(big))
    message = str(info.value)
    assert (
        "data.tokenizer" in message and "1000" in message and "model.vocab_size is 512" in message
    )
    assert "at least 1000" in message
    fits = SpeedtronicConfig.from_dict(
        {"model": {**MODEL, "vocab_size": 1024}, "data": {"tokenizer": str(big)}}
    )
    assert fits.data.tokenizer == str(big)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "is not a tokenizer.json file"),
        ('{"model": {"type": "BPE"}}', "no model vocabulary"),
        ("[1, 2]", "no model vocabulary"),
    ],
)
def test_a_file_that_is_not_a_tokenizer_is_a_config_error(tmp_path, content, needle):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=needle):
        config(tokenizer=str(path))


def test_a_tokenizer_json_the_library_cannot_parse_fails_when_loaded(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "Nope", "vocab": {"a": 0}}, "added_tokens": []}))
    config(tokenizer=str(path))  # the vocabulary reads fine ...
    with pytest.raises(ConfigError, match="does not parse as a tokenizer"):
        load_tokenizer(str(path))  # ... but tokenizers refuses the model type


def test_missing_file_and_bad_names(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer file not found"):
        config(tokenizer=str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="without a tokenizer"):
        config(tokenizer=str(tmp_path))
    with pytest.raises(ConfigError, match="tokenizer file not found"):
        config(tokenizer="not a repo id!")


def test_tokenizer_config_names_the_end_of_text_token(tmp_path, bpe):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "fox"}}))
    with pytest.raises(ConfigError, match="names eos_token 'fox'"):
        config(tokenizer=str(folder))
    no_eos = train_bpe(tmp_path / "plain.json", eos=None)
    assert load_tokenizer(str(no_eos)).eos_id is None


def test_text_streaming_tokenizes_whole_words_and_ends_with_eos(tmp_path, bpe):
    text = corpus_text(300)
    path = tmp_path / "train.txt"
    path.write_text(text)
    tokenizer = load_tokenizer(str(bpe))
    expected = [*tokenizer.encode(text), tokenizer.eos_id]
    for chunk in (64, 1000, 1 << 16):  # small chunks: cuts land mid-line, carried to a newline
        dataset = TextFileTokenDataset(path, 8, tokenizer=tokenizer, chunk_chars=chunk)
        assert torch.cat(list(dataset.token_chunks())).tolist() == expected
    held = TextFileTokenDataset(path, 8, tokenizer=tokenizer, stop_byte=len(text) // 2)
    assert tokenizer.eos_id not in torch.cat(list(held.token_chunks())).tolist()


def test_the_configured_tokenizer_drives_training_text_and_eval(tmp_path, bpe):
    path = tmp_path / "train.txt"
    path.write_text(corpus_text(400))
    cfg = SpeedtronicConfig.from_dict(
        {
            "model": dict(MODEL),
            "data": {
                "text_path": str(path),
                "tokenizer": str(bpe),
                "micro_batch_size": 2,
                "target_batch_size": 2,
            },
            "eval": {"holdout": 0.1, "tokens": 64},
        }
    )
    from speedtronic.data import build_node_dataloader

    inputs, _ = next(iter(build_node_dataloader(cfg, "w1")))
    tokenizer = load_tokenizer(str(bpe))
    assert inputs.max() < 300 and inputs.max() >= 256  # BPE merges, not bytes
    window = tokenizer.encode(path.read_text())[:17]
    assert inputs[0].tolist() == window[:16]
    heldout = build_heldout(cfg)
    tail = torch.cat([b[0].reshape(-1) for b in heldout.batches]).tolist()
    assert max(tail) >= 256  # the held-out end is tokenized the same way


def test_validate_resolves_a_hub_repo_id_through_huggingface_hub(
    tmp_path,
    hub_emulator,
    bpe,
):
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub_emulator.url, token=TEST_TOKEN)
    api.create_repo("org/tok")
    api.upload_file(path_or_fileobj=str(bpe), path_in_repo="tokenizer.json", repo_id="org/tok")
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump({"model": {**MODEL, "vocab_size": 256}, "data": {"tokenizer": "org/tok"}})
    )
    env = {
        **os.environ,
        "HF_ENDPOINT": hub_emulator.url,
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_TOKEN": TEST_TOKEN,
        "PYTHONPATH": str(REPO),
    }
    done = run_speedtronic("validate", "--config", str(path), env=env, timeout=120)
    assert done.returncode == 2
    assert "org/tok has 300 token ids but model.vocab_size is 256" in done.stderr
    assert TEST_TOKEN not in done.stderr
    path.write_text(yaml.safe_dump({"model": dict(MODEL), "data": {"tokenizer": "org/tok"}}))
    done = run_speedtronic("validate", "--config", str(path), env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tokenizer: org/tok" in done.stdout


def test_cli_validate_exit_2_for_a_vocabulary_that_does_not_fit(tmp_path, capsys):
    big = word_level(tmp_path / "big.json", 5000)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": dict(MODEL), "data": {"tokenizer": str(big)}}))
    assert main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "5000 token ids" in err[0] and "model.vocab_size is 512" in err[0]


def test_importing_the_config_never_imports_tokenizers_or_torch():
    code = (
        "import sys, speedtronic.config, speedtronic.cli; "
        "print(sorted({'torch', 'tokenizers', 'numpy'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
