"""DumbDiLoCo benchmarks, each against a peer measured in the same run.

(a) ``inner``: inner-loop step time of the reference transformer with a DumbDiLoCo worker
    hooked on its optimizer (``sync: overlapped``: uploads run in the background and the
    transport holds each for ``--latency`` s, as a network would; an instant master answers
    each upload with the next global, which the worker polls and merges) vs the same loop
    with the hook detached; blocks alternate, medians.
(b) ``outer``: master aggregation + Nesterov outer step for N deltas of P parameters
    (``average_deltas`` + ``NesterovOuterOptimizer.step``) vs a hand-written torch add/mul
    loop over the same tensors.
(c) ``bytes``: bytes uploaded per round per worker for fp32, bf16 and fp16 deltas.

    python bench/diloco.py                     # CPU, small shapes (~1 min)
    python bench/diloco.py --out bench/results/diloco.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.config import DistributedConfig
from speedtronic.diloco.codec import average_deltas, cpu_state_dict, delta_to_bytes, floating_state
from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.master import NesterovOuterOptimizer
from speedtronic.model import build_model
from speedtronic.retry import RetryPolicy


class SlowTransport(DirectoryTransport):
    """Shared-volume transport whose uploads take ``latency`` extra seconds (network-like);
    after each upload it publishes the next global itself (an instant, non-averaging master)."""

    def __init__(self, repo_id: str, latency: float, state: dict):
        super().__init__(repo_id, RetryPolicy(0.01, 0.1, 2))
        self.latency = latency
        self.state = state
        self.publish_global(state, outer_step=0)

    def upload_delta(self, delta, **kwargs):
        time.sleep(self.latency)
        path = super().upload_delta(delta, **kwargs)
        self.publish_global(self.state, outer_step=kwargs["round_index"] + 1)
        return path


class _Quiet:
    def __init__(self):
        self.events: list[str] = []

    def emit(self, event, payload):
        self.events.append(event)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from speedtronic.config import ModelConfig

    cfg = ModelConfig(
        name="reference_transformer",
        vocab_size=256,
        max_seq_len=args.seq,
        n_layer=args.layers,
        n_head=4,
        n_kv_head=4,
        d_model=args.d_model,
        d_ff=None,
        dropout=0.0,
        tie_weights=True,
        rope_base=10000.0,
    )
    return build_model(cfg)


def bench_inner(args: argparse.Namespace) -> dict:
    """(a) step time with the coordinator on vs off, same model, alternating blocks."""
    torch.manual_seed(0)
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 256, (args.batch, args.seq + 1))
    tmp = Path(tempfile.mkdtemp(prefix="bench-diloco-"))
    cfg = DistributedConfig(
        enabled=True,
        repo_id=f"file://{tmp}/repo",
        role="worker",
        node_id="bench",
        inner_steps=args.inner_steps,
        sync="overlapped",
        poll_interval=0.05,
        round_timeout=30.0,
    )
    transport = SlowTransport(
        f"file://{tmp}/repo", args.latency, cpu_state_dict(model.state_dict())
    )
    coord = DumbDiLoCoCoordinator(
        cfg, model, hub=transport, state_dir=tmp / "state", logger=_Quiet(), environ={}
    )
    coord.start()

    def one() -> float:
        t0 = time.perf_counter()
        out = model(batch[:, :-1])
        logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()  # the attached coordinator runs its round in a step post-hook
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(3):
        one()
    off, on = [], []
    for _ in range(args.blocks):
        coord.node.detach()
        off += [one() for _ in range(args.block_steps)]
        coord.attach(opt)
        on += [one() for _ in range(args.block_steps)]
    coord.stop()
    uploads = len([e for e in coord.logger.events if e == "delta_uploaded"])
    off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
    mean_off, mean_on = statistics.fmean(off) * 1e3, statistics.fmean(on) * 1e3
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "inner_steps": args.inner_steps,
        "upload_latency_s": args.latency,
        "steps_each": len(off),
        "uploads": uploads,
        "off_median_ms": off_ms,
        "on_median_ms": on_ms,
        "ratio_median": on_ms / off_ms,
        "off_mean_ms": mean_off,
        "on_mean_ms": mean_on,
        "ratio_mean": mean_on / mean_off,
    }


def bench_outer(args: argparse.Namespace) -> dict:
    """(b) aggregation + outer step vs plain torch on the same tensors."""
    torch.manual_seed(0)
    shapes = [(args.outer_dim, args.outer_dim)] * args.outer_tensors
    state = {f"p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    deltas = [{k: torch.randn_like(v) * 1e-3 for k, v in state.items()} for _ in range(args.deltas)]

    def ours() -> float:
        st = {k: v.clone() for k, v in state.items()}
        opt = NesterovOuterOptimizer(st, lr=0.7, momentum=0.9)
        t0 = time.perf_counter()
        opt.step(st, average_deltas(deltas))
        return time.perf_counter() - t0

    def plain() -> float:
        st = {k: v.clone() for k, v in state.items()}
        bufs = {k: torch.zeros_like(v) for k, v in st.items()}
        t0 = time.perf_counter()
        for key, weight in st.items():
            mean = deltas[0][key].clone()
            for d in deltas[1:]:
                mean.add_(d[key])
            mean.div_(len(deltas))
            bufs[key].mul_(0.9).add_(mean)
            weight.sub_(0.7 * (mean + 0.9 * bufs[key]))
        return time.perf_counter() - t0

    ours_t, plain_t = [], []
    for _ in range(args.outer_repeats):
        ours_t.append(ours())
        plain_t.append(plain())
    # the two must agree numerically
    a = {k: v.clone() for k, v in state.items()}
    NesterovOuterOptimizer(a, 0.7, 0.9).step(a, average_deltas(deltas))
    b = {k: v.clone() for k, v in state.items()}
    for k in b:  # the first step from zero momentum: buf = g, w -= lr * (g + 0.9 * buf)
        mean = sum(d[k] for d in deltas) / len(deltas)
        b[k].sub_(0.7 * (mean + 0.9 * mean))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    o, p = statistics.median(ours_t) * 1e3, statistics.median(plain_t) * 1e3
    return {
        "deltas": args.deltas,
        "params": sum(v.numel() for v in state.values()),
        "ours_ms": o,
        "torch_ms": p,
        "ratio": o / p,
    }


def bench_bytes(args: argparse.Namespace) -> dict:
    """(c) bytes per delta upload (one per worker per round) by wire dtype."""
    torch.manual_seed(0)
    model = _model(args)
    delta = {k: torch.randn_like(v) * 1e-3 for k, v in floating_state(model.state_dict()).items()}
    out = {"params": sum(v.numel() for v in delta.values())}
    for name in ("fp32", "bf16", "fp16"):
        data = delta_to_bytes(delta, node_id="w", local_step=1, base_outer_step=0, dtype=name)
        out[f"{name}_bytes"] = len(data)
    out["bf16_vs_fp32"] = out["bf16_bytes"] / out["fp32_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--latency", type=float, default=0.3)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-steps", type=int, default=20)
    parser.add_argument("--deltas", type=int, default=8)
    parser.add_argument("--outer-dim", type=int, default=512)
    parser.add_argument("--outer-tensors", type=int, default=8)
    parser.add_argument("--outer-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "diloco.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": args.threads,
        "inner": bench_inner(args),
        "outer": bench_outer(args),
        "bytes": bench_bytes(args),
    }
    inner, outer, nbytes = results["inner"], results["outer"], results["bytes"]
    print(
        f"(a) inner step: off {inner['off_median_ms']:.2f} ms, on {inner['on_median_ms']:.2f} ms"
        f" -> ratio {inner['ratio_median']:.3f} (mean ratio {inner['ratio_mean']:.3f},"
        f" {inner['uploads']} uploads, each held {inner['upload_latency_s']} s)"
    )
    print(
        f"(b) outer step, {outer['deltas']} deltas x {outer['params']} params: ours"
        f" {outer['ours_ms']:.1f} ms vs torch {outer['torch_ms']:.1f} ms -> ratio"
        f" {outer['ratio']:.3f}"
    )
    print(
        f"(c) bytes per worker per round ({nbytes['params']} params): fp32"
        f" {nbytes['fp32_bytes']}, bf16 {nbytes['bf16_bytes']}, fp16 {nbytes['fp16_bytes']}"
        f" -> bf16/fp32 {nbytes['bf16_vs_fp32']:.3f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
