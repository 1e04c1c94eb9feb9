"""A training node's memory for DiLoCo (issue 22, item 4): its peak over a run, minus the
same process trained without DiLoCo, over the fp32 model's bytes.

The node runs alone in a child process: a model of the shapes of ``bench/diloco_scale.py``
(default 26.2M parameters), an SGD inner optimizer whose gradients are seeded noise, and the
real coordinator (node, uploader, inbox) on a shared-directory exchange. The round master
runs in this process, so its memory is not counted. The child's baseline is its peak after
the model, a few optimizer steps and one warm-up write and read of a safetensors file (the
code paths a round imports), before the coordinator exists; what the run adds above it is
the node's exchange overhead: its anchor, the contribution in flight, the global being
installed, and, with a lossy wire format, its error-feedback residual (``--no-error-feedback``:
without it). One row per wire format; each row's run is ``--rounds`` rounds of
``--inner-steps`` steps, blocking.

    python bench/diloco_node_memory.py                          # fp32 bf16 int8 int4, 26.2M
    python bench/diloco_node_memory.py --d-model 64 --layers 2  # quick
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from diloco_scale import model_shapes  # noqa: E402

from speedtronic.config import DistributedConfig  # noqa: E402
from speedtronic.diloco.directory import DirectoryTransport  # noqa: E402
from speedtronic.diloco.exchange import RoundSettings  # noqa: E402
from speedtronic.diloco.master import RoundMaster  # noqa: E402
from speedtronic.retry import RetryPolicy  # noqa: E402

_NODE = r"""
import json, re, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, {root!r})
from speedtronic.config import DistributedConfig
from speedtronic.diloco.codec import delta_from_bytes, write_delta
from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator

cfg = json.loads(sys.argv[1])
def peak_kib():
    return int(re.search(r"VmHWM:\s*(\d+) kB", Path("/proc/self/status").read_text()).group(1))

class Model(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        for key, shape in shapes.items():
            self.register_parameter(key.replace(".", "_"), torch.nn.Parameter(torch.zeros(shape)))

torch.manual_seed(0)
model = Model(cfg["shapes"])
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
def train_step():
    for p in model.parameters():
        p.grad = torch.randn(p.shape).mul_(1e-3)
    optimizer.step()
for _ in range(2):
    train_step()
with tempfile.TemporaryDirectory() as tmp:  # the safetensors paths a round uses, warmed up
    with open(Path(tmp) / "warm.safetensors", "wb") as handle:
        write_delta(handle, {{"w": torch.ones(256)}}, node_id="n", local_step=1,
                    base_outer_step=0, dtype=cfg["wire"])
    delta_from_bytes((Path(tmp) / "warm.safetensors").read_bytes())
baseline_kib = peak_kib()
settings = DistributedConfig(
    enabled=True, repo_id="file://" + cfg["exchange"], role="worker", node_id="n0",
    inner_steps=cfg["inner_steps"], sync="blocking", round_timeout=600.0, poll_interval=0.05,
    delta_dtype=cfg["wire"], async_global_poll=False, error_feedback=cfg["error_feedback"],
)
coordinator = DumbDiLoCoCoordinator(settings, model, state_dir=cfg["state_dir"])
coordinator.attach(optimizer)
coordinator.start(0)
for _ in range(cfg["rounds"] * cfg["inner_steps"]):
    train_step()
coordinator.finish()
coordinator.stop()
print(json.dumps({{"baseline_kib": baseline_kib, "peak_kib": peak_kib(),
                   "installed": coordinator.node.rounds.installed}}))
"""


def measure(
    wire: str, shapes: dict[str, tuple[int, ...]], rounds: int, inner: int, feedback: bool = True
) -> dict:
    """One node's run with wire format ``wire`` (error feedback on or off) against a master
    in this process."""
    with tempfile.TemporaryDirectory(prefix="diloco-node-memory-") as tmp:
        root = Path(tmp)
        store = DirectoryTransport(f"file://{root / 'exchange'}", RetryPolicy(attempts=3))
        master = RoundMaster(
            store,
            {k.replace(".", "_"): torch.zeros(v) for k, v in shapes.items()},
            settings=RoundSettings.of(
                DistributedConfig(
                    round_timeout=600.0, poll_interval=0.05, min_nodes=1, delta_dtype=wire
                )
            ),
            state_dir=root / "master",
        )
        master.reconcile()
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set() and not master.finished.is_set():
                if not master.poll_once():
                    time.sleep(0.05)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        cfg = {
            "shapes": {k: list(v) for k, v in shapes.items()},
            "wire": wire,
            "exchange": str(root / "exchange"),
            "state_dir": str(root / "node"),
            "rounds": rounds,
            "inner_steps": inner,
            "error_feedback": feedback,
        }
        script = _NODE.format(root=str(REPO))
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        stop.set()
        thread.join(10)
        if done.returncode != 0:
            raise RuntimeError(f"the node failed ({wire}):\n{done.stdout}\n{done.stderr}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
    model_bytes = 4 * sum(math.prod(s) for s in shapes.values())
    overhead = (result["peak_kib"] - result["baseline_kib"]) * 1024
    return {
        "wire": wire,
        "error_feedback": feedback,
        "parameters": model_bytes // 4,
        "model_mib": model_bytes / 2**20,
        "baseline_mib": result["baseline_kib"] / 1024,
        "peak_mib": result["peak_kib"] / 1024,
        "overhead_mib": overhead / 2**20,
        "overhead_over_model": overhead / model_bytes,
        "rounds_installed": result["installed"],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the rows, print the table, write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wires", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="lossy formats without their residual (distributed.error_feedback: false)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/diloco_node_memory.json")
    args = parser.parse_args(argv)
    shapes = model_shapes(args.d_model, args.layers, args.vocab)
    rows = []
    print(f"{'wire':<6} {'model MiB':>10} {'overhead MiB':>13} {'x model':>8} {'rounds':>7}")
    for wire in args.wires:
        row = measure(wire, shapes, args.rounds, args.inner_steps, not args.no_error_feedback)
        rows.append(row)
        print(
            f"{wire:<6} {row['model_mib']:>10.1f} {row['overhead_mib']:>13.1f} "
            f"{row['overhead_over_model']:>8.2f} {row['rounds_installed']:>7}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
