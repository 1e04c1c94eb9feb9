"""bench/optimizers.py --quick: the three parts run on the current builders and report NS dtypes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from speedtronic.optim import resolve_ns_dtype

BENCH = Path(__file__).resolve().parents[1] / "bench" / "optimizers.py"


def test_quick_run_reports_ratio_ns_dtype_and_both_precisions(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_optimizers", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["optimizers.py", "--quick", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        module.main()
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "muon_ns_dtype auto ->" in printed and "ratio ours / torch.optim.Muon" in printed
    result = json.loads(out.read_text())
    auto = str(resolve_ns_dtype("auto", "cpu")).removeprefix("torch.")
    assert result["muon_vs_torch"]["ours_ns_dtype"] == auto
    assert isinstance(result["cpu_native_bf16"], bool)
    assert result["muon_vs_torch"]["ratio_ours_vs_torch"] > 0
    convergence = result["convergence"]
    bf16, fp32 = convergence["muon_ns_bf16"], convergence["muon_ns_fp32"]
    assert abs(bf16["best_held_out_loss"] - fp32["best_held_out_loss"]) < 0.05
