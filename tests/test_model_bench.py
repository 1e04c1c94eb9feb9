"""bench/model_vs_transformers.py: skip without transformers; same function as Llama with it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "model_vs_transformers.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("model_vs_transformers", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_skips_cleanly_without_transformers(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    out = tmp_path / "r.json"
    assert load_bench().main(["--out", str(out)]) == 0
    assert "skip: transformers is not installed" in capsys.readouterr().out
    assert not out.exists()


def test_llama_of_the_same_shape_computes_the_same_logits(tmp_path):
    pytest.importorskip("transformers")
    bench = load_bench()
    shape = {"vocab_size": 64, "d_model": 32, "n_layer": 1, "n_head": 4, "n_kv_head": 2}
    ours, llama = bench.build_pair(shape, 16)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in llama.parameters())
    ids = torch.randint(0, 64, (2, 16))
    assert bench.max_logit_difference(ours, llama, ids) < 1e-5
    out = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--steps", "1"]
    assert bench.main([*argv, "--rounds", "1", "--warmup", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ratio_speedtronic_over_transformers"] > 0
