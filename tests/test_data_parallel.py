"""Several ranks per node (``run.nproc_per_node``): torchrun's agent, DDP over gloo on CPU.

- ``nproc_per_node`` resolution and validation; torchrun's rank environment.
- The ranks' data shards are disjoint and together are the single process's batches; a
  position saved by 2 ranks resumes on 1.
- 2 ranks (DDP, and FSDP2 with its unsharded checkpoint) after N steps hold the parameters of
  one process with twice the micro-batch (fp32 tolerance), and their checkpoint resumes in a
  1-rank run that then equals the single run.
- A 2-rank DiLoCo node completes rounds against a master over a shared directory.
- A dead rank ends the node non-zero, naming the rank, within the collective timeout; a SIGTERM
  to one rank stops both at the same step with a final checkpoint; rank 0 alone serves
  ``/metrics``, with the node's token count.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from process_support import STARTED, child_env, free_port, jsonl_events, wait_for

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.data import build_dataloader
from speedtronic.train.ranks import RankEnv, resolve_nproc
from speedtronic.train.runtime import build_runtime

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "run": {"name": "dp", "seed": 7, "device": "cpu", "max_steps": 6, "collective_timeout": 30},
    "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32},
    "data": {
        "synthetic": "markov",
        "num_tokens": 512,
        "block_size": 16,
        "micro_batch_size": 2,
        "target_batch_size": 4,
    },
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "scheduler": {"warmup_steps": 2, "max_steps": 50},
    "precision": {"mode": "fp32"},
    "checkpoint": {"every_steps": 3, "keep_last": 5},
    "logging": {"every_steps": 1, "json_file": "events.jsonl"},
    "metrics": {"enabled": False},
}


def _config(tmp: Path, name: str, **sections) -> Path:
    raw = json.loads(json.dumps(TINY))
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _env() -> dict:
    env = child_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _start(tmp: Path, config: Path, *sets: str, out: str = "node.out") -> subprocess.Popen:
    args = [sys.executable, "-m", "speedtronic", "train", "--config", str(config)]
    for item in sets:
        args += ["--set", item]
    with open(tmp / out, "ab") as sink:
        proc = subprocess.Popen(args, cwd=tmp, env=_env(), stdout=sink, stderr=subprocess.STDOUT)
    STARTED.append(proc)
    return proc


def _wait(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"did not finish: {log.read_text()[-3000:]}") from None


def _ranks_of(agent: int) -> dict[int, int]:
    """{RANK: pid} of the agent's worker processes (from /proc)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != agent:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


# ----------------------------------------------------------------------------- resolution


def test_nproc_per_node_resolution_and_validation():
    def cfg(**run) -> SpeedtronicConfig:
        return SpeedtronicConfig.from_dict({"run": run})

    assert cfg().run.nproc_per_node == 1
    assert cfg(nproc_per_node="AUTO").run.nproc_per_node == "auto"
    assert cfg(nproc_per_node="3").run.nproc_per_node == 3
    assert resolve_nproc(cfg(nproc_per_node=2)) == 2
    assert resolve_nproc(cfg(nproc_per_node="auto", device="cpu"), gpus=8) == 1  # CPU: 1
    assert resolve_nproc(cfg(nproc_per_node="auto", device="auto"), gpus=0) == 1
    assert resolve_nproc(cfg(nproc_per_node="auto", device="cuda"), gpus=4) == 4
    if not torch.cuda.is_available():
        assert resolve_nproc(cfg(nproc_per_node="auto")) == 1  # this machine: no GPU
    master = SpeedtronicConfig.from_dict(
        {
            "run": {"nproc_per_node": 4},
            "distributed": {"enabled": True, "role": "master", "repo_id": "file:///tmp/x"},
        }
    )
    assert resolve_nproc(master) == 1  # a master aggregates on one process
    for bad, text in [(0, "greater than 0 .or 'auto'."), ("many", "an integer"), (True, "integer")]:
        with pytest.raises(ConfigError, match=text):
            cfg(nproc_per_node=bad)
    with pytest.raises(ConfigError, match="'ddp' or 'fsdp', got str 'zero3'"):
        cfg(data_parallel="zero3")
    with pytest.raises(ConfigError, match="collective_timeout"):
        cfg(collective_timeout=0)
    env = RankEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.joined, env.is_main) == (
        1,
        2,
        1,
        True,
        False,
    )
    assert not RankEnv.from_environ({}).joined


# ----------------------------------------------------------------------------- data shards


def _samples(loader, batches: int) -> list[list[int]]:
    rows: list[list[int]] = []
    stream = iter(loader)
    for _ in range(batches):
        inputs, _labels = next(stream)
        rows.extend(inputs.tolist())
    return rows


@pytest.mark.parametrize("source", ["markov", "text"])
def test_rank_shards_are_disjoint_and_make_up_the_single_process_batches(tmp_path, source):
    data = dict(TINY["data"], num_tokens=64)
    if source == "text":
        text = tmp_path / "corpus.txt"
        text.write_text("".join(chr(97 + (i * 7) % 26) for i in range(4000)))
        data = dict(data, text_path=str(text), synthetic="none")
    config = SpeedtronicConfig.from_dict({**TINY, "data": data})

    def loader(micro: int, rank: int = 0, world: int = 1):
        section = SpeedtronicConfig.from_dict(
            {**TINY, "data": dict(data, micro_batch_size=micro, target_batch_size=micro)}
        ).data
        return build_dataloader(section, vocab_size=64, rank=rank, world_size=world)

    single = _samples(loader(4), 6)
    rank0, rank1 = _samples(loader(2, 0, 2), 6), _samples(loader(2, 1, 2), 6)
    for i in range(6):
        assert rank0[2 * i : 2 * i + 2] + rank1[2 * i : 2 * i + 2] == single[4 * i : 4 * i + 4]
    assert config.data.micro_batch_size == 2
    # a 2-rank position (4 batches of 2 per rank) continues a 1-rank loader of 4 per batch
    two = loader(2, 0, 2)
    _samples(two, 4)
    assert two.state_dict() == {"epoch": 0, "batches": 4, "batch_size": 2, "ranks": 2}
    one = loader(4)
    one.load_state_dict(two.state_dict())
    assert _samples(one, 2) == single[16:24]


# ----------------------------------------------------------------------------- training


def _params(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state.items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _checkpoint(directory: Path, step: int) -> dict:
    path = directory / "checkpoints" / f"step_{step:012d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process_with_twice_the_micro_batch_and_resume_on_one(tmp_path, mode):
    two = tmp_path / "two"
    run = {"nproc_per_node": 2, "output_dir": str(two), "data_parallel": mode}
    config = _config(tmp_path, "two", run=run)
    began = time.monotonic()
    proc = _start(tmp_path, config)
    assert _wait(proc, 240, tmp_path / "node.out") == 0, (tmp_path / "node.out").read_text()
    wall = time.monotonic() - began
    output = (tmp_path / "node.out").read_text()
    assert output.count("completed steps=6") == 1  # rank 0 reports, rank 1 stays quiet
    start = jsonl_events(two / "events.jsonl", "train_start")[0]
    assert (start["ranks"], start["data_parallel"]) == (2, mode)
    steps = jsonl_events(two / "events.jsonl", "train_step")
    assert steps[-1]["tokens"] == 6 * 2 * 4 * 16  # node tokens: both ranks
    replicas = jsonl_events(two / "events.jsonl", "replicas")  # FSDP: shards, nothing to compare
    assert [row["spread"] for row in replicas] == ([0.0] if mode == "ddp" else [])

    double = {"micro_batch_size": 4, "target_batch_size": 8}
    reference = SpeedtronicConfig.from_dict(
        {**TINY, "data": dict(TINY["data"], **double), "run": dict(TINY["run"], max_steps=9)}
    )
    reference.run.output_dir = str(tmp_path / "one")
    trainer, _ = build_runtime(reference, max_steps=6)
    trainer.fit()
    saved = _checkpoint(two, 6)
    diff = _max_diff(_params(trainer.model.state_dict()), _params(saved["model"]))
    assert diff < 1e-5, diff
    print(f"{mode} 2 ranks vs 1 process, 6 steps: max |diff| {diff:.2e}; run {wall:.1f} s")

    # resume the 2-rank checkpoint on one rank (same node batch): equals the single run
    trainer.fit(9)
    resumed = SpeedtronicConfig.from_dict(
        {**TINY, "data": dict(TINY["data"], **double), "run": dict(TINY["run"], max_steps=9)}
    )
    resumed.run.output_dir = str(two)
    again, _ = build_runtime(resumed, resume=True)
    assert again.step == 6 and again.tokens == 6 * 8 * 16
    again.fit()
    diff = _max_diff(_params(trainer.model.state_dict()), _params(again.model.state_dict()))
    assert diff < 1e-5, diff
    again.logger.close()
    trainer.logger.close()


def _diloco_node(tmp: Path, mode: str) -> tuple[list[str], dict, dict]:
    """A non-training master and one 2-rank worker node (``mode``) over a shared directory,
    blocking rounds of 3 steps, outer lr 0.5 (so a global differs from the node's weights).
    Returns the master's included contributions, the final global and the worker's final
    weights (its last checkpoint)."""
    from speedtronic.diloco.directory import DirectoryTransport

    tmp.mkdir()
    exchange = tmp / "exchange"
    diloco = {
        "enabled": True,
        "repo_id": f"file://{exchange}",
        "inner_steps": 3,
        "sync": "blocking",
        "poll_interval": 0.1,
        "round_timeout": 60,
        "outer_lr": 0.5,
        "outer_momentum": 0.0,
        "retry_initial": 0.05,
        "retry_max": 0.2,
        "request_timeout": 5,
    }
    master_dir, worker_dir = tmp / "master", tmp / "worker"
    master_cfg = _config(
        tmp,
        "master",
        run={"max_steps": 9, "output_dir": str(master_dir)},
        distributed=dict(diloco, role="master", node_id="master", train=False, min_nodes=1),
    )
    run = {"max_steps": 9, "output_dir": str(worker_dir), "nproc_per_node": 2}
    worker_cfg = _config(
        tmp,
        "worker",
        run=dict(run, data_parallel=mode),
        distributed=dict(diloco, role="worker", node_id="gpu-node"),
    )
    master = _start(tmp, master_cfg, out="master.out")
    worker = _start(tmp, worker_cfg, out="worker.out")
    assert _wait(worker, 240, tmp / "worker.out") == 0, (tmp / "worker.out").read_text()
    assert _wait(master, 120, tmp / "master.out") == 0, (tmp / "master.out").read_text()
    included = [
        item
        for row in jsonl_events(master_dir / "events.jsonl", "outer_step")
        for item in row["included"]
    ]
    for label in range(3):  # one contribution per round: rank 0 alone uploads
        assert included.count(f"gpu-node/{label}") == 1, included
    assert sorted(p.name for p in (exchange / "nodes").iterdir()) == ["gpu-node", "master"]
    assert [p.name for p in worker_dir.rglob("*.jsonl")] == ["events.jsonl"]
    # FSDP: shards, none to compare
    replicas = jsonl_events(worker_dir / "events.jsonl", "replicas")
    assert [row["spread"] for row in replicas] == ([0.0] if mode == "ddp" else [])
    transport = DirectoryTransport(f"file://{exchange}")
    meta = transport.global_metadata()
    assert meta.final and meta.outer_step == 3
    final = _params(transport.read_global(meta))
    return included, final, _params(_checkpoint(worker_dir, 9)["model"])


@pytest.mark.slow
def test_two_rank_diloco_node_completes_rounds_ddp_and_fsdp_alike(tmp_path):
    """Rank 0 alone takes part in the rounds; every rank ends on the final global (with FSDP
    through rank 0's full copy: gathered for the round, sharded back after a merge); FSDP and
    DDP nodes train the same model."""
    finals = {}
    for mode in ("ddp", "fsdp"):
        _, final, weights = _diloco_node(tmp_path / mode, mode)
        assert _max_diff(final, weights) < 1e-6, mode  # the final global, on every rank's shard
        finals[mode] = final
    diff = _max_diff(finals["ddp"], finals["fsdp"])
    assert diff < 1e-5, diff
    print(f"final global, FSDP vs DDP node: max |diff| {diff:.2e}")


@pytest.mark.slow
def test_a_dead_rank_ends_the_node_non_zero_within_the_timeout(tmp_path):
    out = tmp_path / "node.out"
    config = _config(
        tmp_path,
        "long",
        run={"nproc_per_node": 2, "max_steps": 100000, "output_dir": str(tmp_path / "run")},
        checkpoint={"every_steps": 1000},
        logging={"every_steps": 50},
    )
    proc = _start(tmp_path, config)
    events = tmp_path / "run" / "events.jsonl"
    wait_for(lambda: jsonl_events(events, "train_step"), 120, "training to start", interval=0.1)
    ranks = _ranks_of(proc.pid)
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    code = _wait(proc, 60, out)
    elapsed = time.monotonic() - killed
    text = out.read_text()
    assert code == 1, text[-2000:]
    assert "rank 1" in text and "SIGKILL" in text, text[-2000:]
    assert elapsed < 30, elapsed  # run.collective_timeout
    print(f"dead rank: node exited {code} after {elapsed:.1f} s")


def _tokens_total(port: int) -> float:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("speedtronic_train_tokens_total{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    out = tmp_path / "node.out"
    run_dir = tmp_path / "run"
    port = free_port()
    config = _config(
        tmp_path,
        "long",
        run={"nproc_per_node": 2, "max_steps": 100000, "output_dir": str(run_dir)},
        checkpoint={"every_steps": 1000},
        logging={"every_steps": 50},
        metrics={"enabled": True, "host": "127.0.0.1", "port": port},  # rank 0 alone binds it
    )
    proc = _start(tmp_path, config)
    events = run_dir / "events.jsonl"
    wait_for(lambda: jsonl_events(events, "train_step"), 120, "training to start", interval=0.1)
    # /metrics counts the node's tokens: 2 ranks x 4 sequences x 16 tokens per update
    tokens = _tokens_total(port)
    assert tokens > 0 and tokens % (2 * 4 * 16) == 0, tokens
    os.kill(_ranks_of(proc.pid)[1], signal.SIGTERM)
    assert _wait(proc, 60, out) == 0, out.read_text()[-2000:]
    stopped = jsonl_events(events, "train_stopped")[0]
    assert stopped["reason"] == "stop requested on another rank"
    saved = jsonl_events(events, "checkpoint_saved")[-1]
    assert saved["step"] == stopped["step"]
    assert jsonl_events(events, "replicas")[0]["spread"] == 0.0
