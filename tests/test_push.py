"""``speedtronic push`` (issue 32, item 3): a checkpoint goes to a Hub model repo in one commit,
with a model card, and what ``snapshot_download`` brings back loads in transformers with the
trained logits. The Hub is the project's emulator on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from hub_emulator_fixtures import TEST_TOKEN
from process_support import run_speedtronic
from tokenizer_fixtures import train_bpe, write_corpus

from speedtronic.cli import main
from speedtronic.config import SpeedtronicConfig
from speedtronic.testing.hub_server import FaultConfig, HubEmulator, LfsConfig
from speedtronic.train.scoring import load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 12-step run on a BPE tokenizer with held-out eval; returns its folder (the CWD of
    every command below, as a user runs them)."""
    root = tmp_path_factory.mktemp("pushrun")
    corpus = write_corpus(root / "corpus", files=4, lines=60)
    tokenizer = train_bpe(root / "tokenizer.json", vocab_size=320)
    text = "\n".join(p.read_text() for p in sorted(corpus.iterdir()))
    (root / "train.txt").write_text(text)
    config = {
        "run": {"name": "push-demo", "max_steps": 12, "output_dir": "run", "device": "cpu"},
        "model": {
            "vocab_size": 320,
            "max_seq_len": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 32,
        },
        "data": {
            "text_path": str(root / "train.txt"),
            "tokenizer": str(tokenizer),
            "micro_batch_size": 2,
            "target_batch_size": 2,
        },
        "optimizer": {"lr": 3e-3},
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "fp32"},
        "eval": {"holdout": 0.1, "every_steps": 4, "tokens": 256, "batch_size": 4},
        "checkpoint": {"every_steps": 6, "keep_last": 2},
        "logging": {"json_file": "events.jsonl", "every_steps": 4},
    }
    (root / "push.yaml").write_text(yaml.safe_dump(config))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["train", "--config", "push.yaml"]) == 0
    finally:
        os.chdir(cwd)
    return root


def _push(root: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=url, HF_TOKEN=TEST_TOKEN, HF_HOME=str(root / "hf-home"))
    env.update(HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
    return run_speedtronic("push", "--config", "push.yaml", *args, cwd=root, env=env, timeout=180)


def test_push_uploads_one_commit_that_transformers_loads(trained, tmp_path, monkeypatch):
    from huggingface_hub import constants, snapshot_download

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the emulator speaks LFS
    emulator = HubEmulator(0, token=TEST_TOKEN, faults=FaultConfig(seed=3), lfs=LfsConfig(4096))
    emulator.start()
    try:
        result = _push(trained, emulator.url, "--repo", "org/pushed", "--private")
        assert result.returncode == 0, result.stderr
        assert "pushed org/pushed (step 12)" in result.stdout
        stats = emulator.stats()
        assert stats["commits_by_repo"]["org/pushed"] == 1  # everything in one commit
        assert "model.safetensors" in stats["lfs_files"]["org/pushed"]  # the large-file path
        folder = Path(
            snapshot_download(
                "org/pushed", endpoint=emulator.url, token=TEST_TOKEN, cache_dir=tmp_path / "c"
            )
        )
        refused = _push(trained, emulator.url, "--repo", "not-a-repo-id")
    finally:
        emulator.stop()
    assert refused.returncode == 2 and "owner/name" in refused.stderr
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md", "speedtronic.json"} <= names  # fmt: skip
    for path in folder.iterdir():  # the token is nowhere in what was published
        assert TEST_TOKEN not in path.read_bytes().decode("latin-1")
    assert TEST_TOKEN not in result.stdout + result.stderr

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config = SpeedtronicConfig.from_yaml(trained / "push.yaml")
    cwd = os.getcwd()
    os.chdir(trained)
    try:
        ours, weights = load_model(config)
    finally:
        os.chdir(cwd)
    ids = torch.tensor([tokenizer.encode("the model learns", add_special_tokens=False)[:16]])
    with torch.no_grad():
        difference = (model(ids).logits - ours(ids)["logits"]).abs().max().item()
    assert weights.step == 12 and difference <= 1e-5

    card = (folder / "README.md").read_text()
    events = [json.loads(line) for line in (trained / "run" / "events.jsonl").open()]
    losses = [e["loss"] for e in events if e["event"] == "eval"]
    assert card.startswith("---\nlibrary_name: transformers")
    assert f"final **{losses[-1]:.4f}**" in card and f"best **{min(losses):.4f}**" in card
    assert "12 optimizer steps, 768 tokens per node" in card  # 12 x 2 samples x 32 tokens
    assert 'AutoModelForCausalLM.from_pretrained("org/pushed")' in card
    assert "2 layers, width 32, 4 attention heads (2 key/value heads)" in card
    assert "torch " in card and "transformers " in card and "name: push-demo" in card


def test_push_retries_a_flaky_hub(trained, tmp_path):
    emulator = HubEmulator(0, token=TEST_TOKEN, faults=FaultConfig(seed=5))
    emulator.start()
    try:
        emulator.set_faults(error_rate=0.5, seed=1)
        result = _push(trained, emulator.url, "--repo", "org/flaky",
                       "--set", "distributed.retry_initial=0.05",
                       "--set", "distributed.retry_attempts=12")  # fmt: skip
        assert result.returncode == 0, result.stderr
        stats = emulator.stats()
    finally:
        emulator.stop()
    assert sum(stats["faults_by_endpoint"].values()) > 0, stats  # faults injected, survived
    assert stats["commits_by_repo"]["org/flaky"] == 1


def test_run_push_to_hub_pushes_the_final_model_after_training(trained, tmp_path, monkeypatch):
    from huggingface_hub import constants, snapshot_download

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    emulator = HubEmulator(0, token=TEST_TOKEN, faults=FaultConfig(seed=3))
    emulator.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=emulator.url, HF_TOKEN=TEST_TOKEN, HF_HUB_DISABLE_XET="1")
    try:
        argv = ["train", "--config", "push.yaml", "--output-dir", "run-pushed", "--max-steps", "6"]
        run = run_speedtronic(*argv, "--set", "run.push_to_hub=org/auto", cwd=trained, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        assert emulator.stats()["commits_by_repo"]["org/auto"] == 1
        folder = Path(
            snapshot_download(
                "org/auto", endpoint=emulator.url, token=TEST_TOKEN, cache_dir=tmp_path / "c"
            )
        )
    finally:
        emulator.stop()
    assert "pushed the model (step 6) to the Hub repo org/auto" in run.stdout + run.stderr
    record = json.loads((folder / "speedtronic.json").read_text())
    assert record["step"] == 6 and "run-pushed" in record["source"]
    assert "final **" in (folder / "README.md").read_text()
