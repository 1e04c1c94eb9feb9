"""``speedtronic push`` (issue 32, item 3): a checkpoint goes to a Hub model repo in one commit,
with a model card, and what ``snapshot_download`` brings back loads in transformers with the
trained logits. The Hub is the project's emulator on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hub_emulator_fixtures import TEST_TOKEN
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
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", "push", "--config", "push.yaml", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


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
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "speedtronic",
                "train",
                "--config",
                "push.yaml",
                "--output-dir",
                "run-pushed",
                "--max-steps",
                "6",
                "--set",
                "run.push_to_hub=org/auto",
            ],
            cwd=trained,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
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


# ----------------------------------------------------------------------------- issue 39
@pytest.fixture
def hub(monkeypatch):
    """The emulator as the Hub of in-process CLI calls (huggingface_hub reads ENDPOINT when an
    HfApi is made); the token from HF_TOKEN."""
    from huggingface_hub import constants

    emulator = HubEmulator(0, token=TEST_TOKEN, faults=FaultConfig(seed=11))
    emulator.start()
    monkeypatch.setattr(constants, "ENDPOINT", emulator.url)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", TEST_TOKEN)
    yield emulator
    emulator.stop()


def _published(emulator: HubEmulator, repo: str) -> dict[str, str]:
    """The text of every file the emulator holds for ``repo`` (safetensors left out)."""
    files = emulator.files(repo)
    return {n: data.decode() for n, data in files.items() if not n.endswith(".safetensors")}


def test_nothing_local_is_published_and_the_card_is_inert(trained, hub, monkeypatch, capsys):
    """Issue 39, items 4, 15, 17: no absolute path (a folder named like a token included) in
    speedtronic.json or the card, run.name cannot add lines or HTML, a private repo is not
    announced as public on a second push, a refused token says to set HF_TOKEN."""
    markdown = pytest.importorskip("markdown_it")
    monkeypatch.chdir(trained)
    monkeypatch.setenv("HF_HOME", str(trained / "hf-home-39"))
    stash = trained / "hf_abcdefghijklmnopqrstuvwx12" / TEST_TOKEN  # token-shaped folder names
    stash.mkdir(parents=True, exist_ok=True)
    newest = sorted((trained / "run" / "checkpoints").glob("*.pt"))[-1]
    (stash / newest.name).write_bytes(newest.read_bytes())
    values = yaml.safe_load((trained / "push.yaml").read_text())
    values["run"]["name"] = "evil\n<script>alert(1)</script>\n```\n<img src=x onerror=alert(2)>"
    (trained / "evil.yaml").write_text(yaml.safe_dump(values))
    argv = ["push", "--config", "evil.yaml", "--repo", "org/inert", "--checkpoint",
            str(stash / newest.name)]  # fmt: skip
    assert main([*argv, "--private"]) == 0, capsys.readouterr().err
    assert "(private model repo)" in capsys.readouterr().err
    assert main(argv) == 0  # again, without --private: the repo stays private and says so
    assert "(private model repo)" in capsys.readouterr().err
    files = _published(hub, "org/inert")
    for name, text in files.items():
        assert str(trained) not in text, name  # no local layout
        assert TEST_TOKEN not in text and "hf_abcdefghijklmnopqrstuvwx12" not in text, name
    record = json.loads(files["speedtronic.json"])
    assert record["source"] == f".../<redacted>/{newest.name}"
    published = record["config"]["data"]
    assert published["tokenizer"] == f".../{trained.name}/tokenizer.json"  # no absolute path
    assert published["text_path"] == f".../{trained.name}/train.txt"
    card = files["README.md"]
    assert "\n# evil &lt;script&gt;alert(1)&lt;/script&gt; &#96;&#96;&#96; &lt;img" in card
    rendered = markdown.MarkdownIt("commonmark").render(card)  # raw HTML allowed, as a Hub
    assert "<script" not in rendered and "<img" not in rendered
    assert "final **" in card  # the evaluations travelled with the checkpoint
    monkeypatch.setenv("HF_TOKEN", "not-the-token")
    assert main(["push", "--config", "push.yaml", "--repo", "org/inert"]) == 2
    err = capsys.readouterr().err
    assert "the Hub rejected the token (HTTP 401) for org/inert: set HF_TOKEN" in err
    assert len(err.strip().splitlines()) == 1


def test_the_card_keeps_the_history_of_the_checkpoints_own_run(trained, hub, monkeypatch):
    """``--checkpoint`` at ``final/`` of another run reads that run's log, not ``--config``'s
    run's; a run that kept no JSONL log still has its evaluations (its checkpoints carry
    them)."""
    from safetensors.torch import save_file

    from speedtronic.publish import push_model

    monkeypatch.chdir(trained)
    config = SpeedtronicConfig.from_yaml(trained / "push.yaml")
    newest = sorted((trained / "run" / "checkpoints").glob("*.pt"))[-1]
    state = torch.load(newest, map_location="cpu", weights_only=True)
    final = trained / "other-run" / "final"  # a DiLoCo master's final/ of another folder
    final.mkdir(parents=True, exist_ok=True)
    weights = {k: v.clone().contiguous() for k, v in state["model"].items()}
    save_file(weights, str(final / "model.safetensors"))
    (final / "meta.json").write_text(json.dumps({"outer_step": 3, "step": 12}))
    events = [{"event": "eval", "run_id": "r", "step": s, "loss": v, "scope": "global"}
              for s, v in ((4, 7.1234), (8, 6.5432), (12, 6.9876))]  # fmt: skip
    events[0]["scope"] = "<script>alert(3)</script>"  # a log is a file that arrives
    (final.parent / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    push_model(config, repo_id="org/other", checkpoint=str(final), endpoint=hub.url)
    card = _published(hub, "org/other")["README.md"]
    assert "final **6.9876** at step 12, best **6.5432** at step 8" in card
    assert "| 8 | global | 6.5432 |" in card
    assert (
        "| 4 | &lt;script&gt;alert(3)&lt;/script&gt; | 7.1234 |" in card and "<script" not in card
    )

    quiet = trained / "quiet.yaml"  # the same run without a JSONL log
    values = yaml.safe_load((trained / "push.yaml").read_text())
    values["logging"] = {"every_steps": 4}
    values["run"].update(output_dir="run-quiet", max_steps=8)
    quiet.write_text(yaml.safe_dump(values))
    assert main(["train", "--config", str(quiet)]) == 0
    assert not list((trained / "run-quiet").glob("*.jsonl"))
    config = SpeedtronicConfig.from_yaml(quiet)
    push_model(config, repo_id="org/quiet", endpoint=hub.url)
    card = _published(hub, "org/quiet")["README.md"]
    assert "No held-out evaluation was recorded" not in card
    assert "at step 8, best" in card and "| 4 | local |" in card


def test_public_paths_keep_relative_names_and_drop_the_local_layout() -> None:
    from speedtronic.publish import inline, public_path

    assert public_path("runs/x/checkpoints") == "runs/x/checkpoints"  # as the config said
    assert public_path("owner/name") == "owner/name"  # a Hub id
    assert public_path("/home/me/data/tokens") == ".../data/tokens"
    assert public_path("~/corpus/train.txt") == ".../corpus/train.txt"
    assert public_path("../../srv/shared/t.json") == ".../shared/t.json"
    assert public_path("file:///mnt/team/exchange") == "file://.../team/exchange"
    assert public_path("bytes") == "bytes"
    assert inline("a\r\nb\u2028c <b>`x`</b> & 'q'") == (
        "a b c &lt;b&gt;&#96;x&#96;&lt;/b&gt; &amp; &#x27;q&#x27;"
    )
