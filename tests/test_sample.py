"""``speedtronic sample`` and ``generate``: seeded, reproducible, greedy/top-k/EOS rules."""

from __future__ import annotations

import pytest
import torch
import yaml
from tokenizer_fixtures import corpus_text, train_bpe

from speedtronic.cli import main
from speedtronic.model import ReferenceTransformer
from speedtronic.train.runtime import train_from_config
from speedtronic.train.sampling import generate

MODEL = {"vocab_size": 300, "max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32}


@pytest.fixture
def model() -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(**{**MODEL, "max_seq_len": 8}).eval()


def test_same_seed_same_tokens_other_seed_other_tokens(model):
    state = torch.get_rng_state()
    first = generate(model, [1, 2, 3], max_new_tokens=40, block_size=8, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not touched
    assert first == generate(model, [1, 2, 3], max_new_tokens=40, block_size=8, seed=5)
    assert first != generate(model, [1, 2, 3], max_new_tokens=40, block_size=8, seed=6)
    assert len(first) == 40 and all(0 <= t < 300 for t in first)


@torch.no_grad()
def test_greedy_and_top_k_one_follow_the_argmax(model):
    ids = [7, 8]
    expected = []
    for _ in range(12):  # context longer than block_size: the window slides
        logits = model(torch.tensor([ids[-8:]]))["logits"][0, -1]
        ids.append(int(logits.argmax()))
        expected.append(ids[-1])
    assert generate(model, [7, 8], max_new_tokens=12, block_size=8, temperature=0) == expected
    top1 = generate(model, [7, 8], max_new_tokens=12, block_size=8, temperature=1.5, top_k=1)
    assert top1 == expected


def test_generation_stops_at_the_end_of_text_token(model):
    free = generate(model, [1], max_new_tokens=30, block_size=8, temperature=0)
    stop = free[3]
    cut = generate(model, [1], max_new_tokens=30, block_size=8, temperature=0, eos_id=stop)
    assert cut == free[: free.index(stop)]


def test_cli_sample_is_reproducible_and_decodes_with_the_tokenizer(tmp_path, capsys):
    bpe = train_bpe(tmp_path / "tokenizer.json", vocab_size=300)
    text = tmp_path / "train.txt"
    text.write_text(corpus_text(300))
    values = {
        "run": {"device": "cpu", "max_steps": 25, "output_dir": str(tmp_path / "run")},
        "model": MODEL,
        "data": {"text_path": str(text), "tokenizer": str(bpe), "micro_batch_size": 4},
        "optimizer": {"lr": 1e-2},
        "scheduler": {"warmup_steps": 2},
        "logging": {"level": "WARNING"},
    }
    values["data"]["target_batch_size"] = 4
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    train_from_config(path)
    argv = ["sample", "--config", str(path), "--prompt", "the quick", "--max-new-tokens", "30"]
    outputs = []
    for seed in ("1", "1", "2"):
        assert main([*argv, "--seed", seed]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]
    assert outputs[0].startswith("the quick") and len(outputs[0]) > len("the quick\n")
    assert "<|endoftext|>" not in outputs[0]


def test_cli_sample_errors_exit_2(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "run": {"output_dir": str(tmp_path / "r")}}))
    assert main(["sample", "--config", str(path), "--prompt", "x"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert main(["sample", "--config", str(path), "--temperature", "-1"]) == 2
    assert "cannot be negative" in capsys.readouterr().err
    torch.save({"model": ReferenceTransformer(**MODEL).state_dict()}, tmp_path / "m.pt")
    assert main(["sample", "--config", str(path), "--checkpoint", str(tmp_path / "m.pt")]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
