"""``--init-from owner/name`` through the Hub emulator: huggingface_hub's download API, the
weights over the large-file (LFS) path, the token from HF_TOKEN, retries on injected 503s,
a worker that fetches no weights, and the same run offline from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hub_emulator_fixtures import TEST_TOKEN, running_emulator
from test_hf_import import run_config, save_llama

from speedtronic.testing.hub_server import LfsConfig

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import json, sys
from pathlib import Path
from speedtronic.config import SpeedtronicConfig
from speedtronic.model.hf_import import resolve_init_from
config = SpeedtronicConfig.from_dict({
    "model": {"init_from": sys.argv[1]},
    "distributed": {"enabled": True, "role": "worker", "repo_id": "file://" + sys.argv[2]},
})
found = resolve_init_from(config)
print(json.dumps({"weights": found.loads_weights, "files": sorted(
    p.name for p in Path(found.folder).iterdir()), "n_kv_head": config.model.n_kv_head}))
"""


@pytest.fixture
def lfs_hub():
    """An emulator whose files of 16 KiB or more take the LFS path: every weight shard here,
    not the tokenizer or the configs."""
    with running_emulator(11, lfs=LfsConfig(threshold=16384)) as emulator:
        yield emulator


def _speedtronic(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_init_from_a_hub_repo_then_offline_from_the_cache(tmp_path, lfs_hub, monkeypatch):
    from huggingface_hub import HfApi, constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the emulator has no Xet

    source = tmp_path / "hf"
    save_llama(source, tokenizer=True, shard="40KB", num_key_value_heads=2)
    api = HfApi(endpoint=lfs_hub.url, token=TEST_TOKEN)
    api.create_repo("org/tiny-llama", private=True)
    api.upload_folder(folder_path=str(source), repo_id="org/tiny-llama")
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))
    assert set(shards) <= set(lfs_hub.stats()["lfs_files"]["org/tiny-llama"])
    env = {
        **os.environ,
        "HF_ENDPOINT": lfs_hub.url,
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_TOKEN": TEST_TOKEN,
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": str(REPO),
        "SPEEDTRONIC_DISTRIBUTED__RETRY_INITIAL": "0.01",
        "SPEEDTRONIC_DISTRIBUTED__RETRY_MAX": "0.05",
    }

    # a DiLoCo worker: config and tokenizer only, no weight file requested
    done = _speedtronic(["-c", WORKER, "org/tiny-llama", str(tmp_path / "x")], env)
    assert done.returncode == 0, done.stderr
    worker = json.loads(done.stdout.strip().splitlines()[-1])
    assert worker["weights"] is False and worker["n_kv_head"] == 2
    assert "tokenizer.json" in worker["files"]
    assert not [name for name in worker["files"] if name.endswith(".safetensors")]
    assert lfs_hub.stats()["counts"].get("GET storage-download", 0) == 0

    # the master / a single run: the weights too, with 503s on the downloads retried
    lfs_hub.set_faults(error_rate=0.15, endpoints="resolve,storage-download")
    values = run_config(tmp_path, data={"text_path": str(tmp_path / "corpus.txt")})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    launch = ["-m", "speedtronic", "train", "--config", str(path), "--init-from", "org/tiny-llama"]
    done = _speedtronic(launch, env)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = lfs_hub.stats()
    assert stats["counts"]["GET storage-download"] >= len(shards)  # weights over LFS
    assert sum(stats["faults_by_endpoint"].values()) > 0  # and faults were met
    assert TEST_TOKEN not in done.stdout + done.stderr
    snapshots = list((tmp_path / "cache").glob("models--org--tiny-llama/snapshots/*"))
    assert len(snapshots) == 1
    for name in [*shards, "model.safetensors.index.json", "config.json", "tokenizer.json"]:
        assert (snapshots[0] / name).read_bytes() == (source / name).read_bytes()

    # offline: the Hub is gone, the cache answers
    lfs_hub.stop()
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    done = _speedtronic([*launch, "--output-dir", str(tmp_path / "offline")], offline)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "offline" / "checkpoints").glob("*.pt"))
    done = _speedtronic([*launch[:-1], "org/never-fetched"], offline)
    assert done.returncode == 2
    assert "org/never-fetched is not in the Hugging Face cache and HF_HUB_OFFLINE=1" in done.stderr


def test_a_repo_the_token_cannot_see_is_a_configuration_error(tmp_path, lfs_hub):
    env = {
        **os.environ,
        "HF_ENDPOINT": lfs_hub.url,
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_TOKEN": TEST_TOKEN,
        "PYTHONPATH": str(REPO),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(tmp_path)))
    done = _speedtronic(
        ["-m", "speedtronic", "train", "--config", str(path), "--init-from", "org/missing@v2"], env
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "model.init_from: download of the Hub model org/missing@v2: not found" in done.stderr
    assert TEST_TOKEN not in done.stderr
