"""bench/gpu_throughput.py: exit 2 without CUDA, the GPT-2-small config, and a CPU smoke run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_exits_2_with_one_clear_line(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert bench.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: bench/gpu_throughput.py needs a CUDA GPU") and "\n" not in err
    assert "--device cpu --tiny" in err and not out.exists()
    assert bench.main(["--device", "cpu", "--out", str(out)]) == 2  # CPU only with --tiny
    assert "only supported with --tiny" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_command_exits_2_on_a_cpu_machine(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


def test_default_config_is_gpt2_small_bf16_compiled_fused_ready(bench):
    args = bench.parse_args([])
    assert args.device == "cuda" and args.peak_flops == 989e12 and args.optimizer == "adamw"
    args.compile = True
    config = bench.make_config(args, torch.device("cuda"), "/tmp/unused")
    model = config.model
    assert (model.n_layer, model.d_model, model.n_head, model.vocab_size) == (12, 768, 12, 50304)
    assert config.data.block_size == 1024 and model.tie_weights
    assert config.precision.mode == "bf16" and config.compile
    assert config.optimizer.fused is None  # probed on CUDA: fused AdamW
    assert not config.checkpoint.enabled
    with torch.device("meta"):
        net = bench.build_model(model)
    parameters = sum(p.numel() for p in net.parameters())
    assert 120e6 < parameters < 130e6


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_tiny_cpu_smoke_run_exercises_both_arms(bench, tmp_path, capsys, optimizer):
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--tiny", "--optimizer", optimizer, "--steps", "2"]
    argv += ["--repeats", "2", "--warmup", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "ratio: trainer / hand loop" in printed and "MFU" in printed
    result = json.loads(out.read_text())
    assert result["shape"] == "tiny" and result["compile"] is False
    assert result["optimizer"] == optimizer
    trainer, hand = result["arms"]["trainer"], result["arms"]["hand"]
    assert len(trainer["tokens_per_sec_runs"]) == len(hand["tokens_per_sec_runs"]) == 2
    assert trainer["tokens_per_sec"] > 0 and hand["tokens_per_sec"] > 0
    assert result["ratio"] == pytest.approx(trainer["tokens_per_sec"] / hand["tokens_per_sec"])
    expected_mfu = 6 * result["parameters"] * trainer["tokens_per_sec"] / result["peak_flops"]
    assert trainer["mfu"] == pytest.approx(expected_mfu)
    assert trainer["peak_memory_bytes"] is None  # CPU: no CUDA allocator
    # Same seed, data and optimizer: the two arms train the same model step for step.
    assert result["max_loss_difference"] < 1e-4
