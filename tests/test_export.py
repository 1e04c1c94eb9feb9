"""``speedtronic export --format hf``: folders transformers loads as Llama with our logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from cli_support import run_cli, write_run_config
from tokenizer_fixtures import train_bpe

from speedtronic.config import SpeedtronicConfig
from speedtronic.model import build_model, register_model
from speedtronic.train.runtime import train_from_config

transformers = pytest.importorskip("transformers")

MODEL = {"vocab_size": 320, "max_seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64}


def write_config(tmp_path: Path, model: dict | None = None, **sections) -> Path:
    base = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(tmp_path / "run")},
        "model": {**MODEL, **(model or {})},
        "data": {"num_tokens": 64, "micro_batch_size": 2, "target_batch_size": 2},
        "optimizer": {"lr": 3e-2},
        "scheduler": {"warmup_steps": 1},
        "logging": {"level": "WARNING"},
    }
    return write_run_config(tmp_path, base, **sections)


def trained_model(path: Path) -> torch.nn.Module:
    config = SpeedtronicConfig.from_yaml(path)
    train_from_config(config)
    checkpoint = sorted((Path(config.run.output_dir) / "checkpoints").glob("*.pt"))[-1]
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    model = build_model(config.model)
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def max_logit_difference(model: torch.nn.Module, folder: Path) -> float:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    inputs = torch.randint(
        model.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1)
    )
    return float((model(inputs)["logits"] - loaded(input_ids=inputs).logits).abs().max())


@pytest.mark.parametrize(
    "shape",
    [
        {"tie_weights": True, "n_kv_head": 2, "rope_base": 10000.0},
        {"tie_weights": False, "n_kv_head": 4, "rope_base": 500.0, "d_ff": 96},
    ],
    ids=["tied-gqa", "untied-mha"],
)
def test_export_from_a_checkpoint_matches_our_logits(tmp_path, capsys, shape):
    path = write_config(tmp_path, shape)
    model = trained_model(path)
    code, out, err = run_cli(capsys, "export", "--config", str(path), "-o", str(tmp_path / "hf"))
    assert code == 0, err
    assert "exported" in out and "step_000000000004.pt" in out
    assert max_logit_difference(model, tmp_path / "hf") <= 1e-4
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "model.safetensors", "speedtronic.json"]  # bytes: no tokenizer
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is shape["tie_weights"]
    provenance = json.loads((tmp_path / "hf" / "speedtronic.json").read_text())
    assert provenance["step"] == 4 and provenance["config"]["model"]["d_model"] == 64


def test_export_carries_the_tokenizer_and_final_folders_work(tmp_path, capsys):
    bpe = train_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=320)
    path = write_config(tmp_path, data={"tokenizer": str(bpe)})
    model = trained_model(path)
    final = tmp_path / "final"
    final.mkdir()
    from safetensors.torch import save_file

    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}  # unshared
    save_file(state, str(final / "model.safetensors"))
    (final / "meta.json").write_text(json.dumps({"outer_step": 7, "step": 40}))
    argv = ["export", "--config", str(path), "--checkpoint", str(final), "-o", str(tmp_path / "hf")]
    code, out, err = run_cli(capsys, *argv, "--verify")
    assert code == 0, err
    assert "verified: max |logit difference| = " in out
    assert max_logit_difference(model, tmp_path / "hf") <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    from speedtronic.data import load_tokenizer

    ours = load_tokenizer(str(bpe))
    text = "the quick brown fox jumps over the lazy dog 12"
    # the end-of-text token first, as `speedtronic sample` starts a prompt (issue 29)
    assert tokenizer(text)["input_ids"] == [ours.eos_id, *ours.encode(text)]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert tokenizer.eos_token == "<|endoftext|>"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == ours.eos_id
    assert json.loads((tmp_path / "hf" / "speedtronic.json").read_text())["outer_step"] == 7


def test_export_of_the_published_global(tmp_path, capsys):
    repo = tmp_path / "exchange"
    path = write_config(tmp_path, distributed={"enabled": True, "repo_id": f"file://{repo}"})
    config = SpeedtronicConfig.from_yaml(path)
    model = build_model(config.model).eval()
    from speedtronic.diloco.coordinator import build_transport

    build_transport(config.distributed).publish_global(model.state_dict(), outer_step=3)
    code, out, err = run_cli(
        capsys, "export", "--config", str(path), "--global", "-o", str(tmp_path / "hf")
    )
    assert "global of file://" in out
    assert code == 0, err
    assert max_logit_difference(model, tmp_path / "hf") <= 1e-4
    assert json.loads((tmp_path / "hf" / "speedtronic.json").read_text())["outer_step"] == 3


def test_a_model_without_a_llama_equivalent_gets_a_clear_error(tmp_path, capsys):
    @register_model("export_test_mlp")
    def tiny(vocab_size: int, d_model: int, **_):
        return torch.nn.Sequential(torch.nn.Embedding(vocab_size, d_model))

    path = write_config(tmp_path, {"name": "export_test_mlp"})
    code, _, err = run_cli(capsys, "export", "--config", str(path), "-o", str(tmp_path / "hf"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "model.name 'export_test_mlp' has no Llama equivalent" in lines[0]
    assert not (tmp_path / "hf").exists()


def test_output_rules_and_missing_transformers(tmp_path, capsys, monkeypatch):
    path = write_config(tmp_path)
    trained_model(path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "export", "--config", str(path), "-o", str(out))
    assert code == 2 and "is not empty; pass --overwrite" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    code, _, err = run_cli(capsys, "export", "--config", str(path), "-o", str(out), "--overwrite")
    assert code == 0, err
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no staging left
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _, err = run_cli(capsys, "export", "--config", str(path), "-o", str(tmp_path / "x"))
    assert code == 2 and "needs the transformers package: pip install transformers" in err
    assert not (tmp_path / "x").exists()
    code, _, err = run_cli(
        capsys, "export", "--config", str(path), "-o", str(tmp_path / "y"), "--checkpoint", "nope"
    )
    assert code == 2 and "checkpoint not found: nope" in err
