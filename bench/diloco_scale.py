"""What a DiLoCo round costs with many nodes (issue 17, item 5).

K simulated nodes skip the training and send seeded pseudo-gradients of a realistic model
shape (default: 26.2M parameters, bf16 on the wire) through the real transports to the real
round master, against the Hub emulator on 127.0.0.1 with injected request latency. Two
layouts are measured:

- ``direct``: every node uploads to the Hub repository (one commit per node and round);
- ``groups``: nodes meet a group leader over a shared directory (``file://``), and each
  leader relays its group's mean to the Hub as one contribution weighing its members
  (``distributed.relay_to``), so the Hub sees G + 1 commits per round instead of K + 1.

The top-level master runs in its own process (its peak memory and CPU are its own); nodes
and group leaders run as threads of this process, at most ``--parallel`` of them moving a
delta at once (this machine's memory and cores, not the protocol, set that bound). Per
layout and K it reports round latency p50/p99 (global r published to global r + 1), Hub
commits and requests per round (per repository, per token), the master's peak memory and CPU
seconds per round, rounds per hour allowed by the Hub's commit budget counted per
repository and per token, whether any contribution was lost or counted twice, and the bytes
each node moves per round (its upload in ``--delta-dtypes``, each a row: bf16, int8, int4, ...;
and the fp32 global it downloads).

``--codec-cost`` measures, in the same run, what a compressed wire costs in time (issue 23):
quantize + dequantize of one whole pseudo-gradient of the shape (what a node does to send it
and keep its residual; the master decodes the same once per node) against the training time
of a round of that shape (``--inner-steps`` optimizer steps of the reference transformer of
the same d_model, layers and vocabulary, batch ``--train-batch`` x ``--train-seq`` tokens,
timed over a few steps on this machine's CPU).

    python bench/diloco_scale.py --nodes 4 16 64 --layouts direct groups
    python bench/diloco_scale.py --nodes 16 --rounds 3 --d-model 64 --layers 2   # quick
    python bench/diloco_scale.py --nodes 4 --layouts direct --rounds 3 \
        --delta-dtypes bf16 int8 int4 --codec-cost          # issue 23's bytes and time
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speedtronic.config import DistributedConfig, ModelConfig  # noqa: E402
from speedtronic.diloco.codec import DELTA_FORMATS, decode_value, encode_delta  # noqa: E402
from speedtronic.diloco.directory import DirectoryTransport  # noqa: E402
from speedtronic.diloco.exchange import RoundSettings  # noqa: E402
from speedtronic.diloco.hub import HubClient  # noqa: E402
from speedtronic.diloco.master import RelayStep, RoundMaster  # noqa: E402
from speedtronic.retry import RetryPolicy  # noqa: E402
from speedtronic.testing.hub_budget import Budget  # noqa: E402
from speedtronic.testing.hub_server import FaultConfig, HubEmulator, token_tag  # noqa: E402

TOP = "bench/diloco-scale"
HUB_COMMITS_PER_HOUR = 128  # docs/diloco.md plans with this (the Hub publishes no number)
HUB_REQUESTS_PER_5_MIN = 1000  # the Hub's published free-account API quota


def model_shapes(d_model: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a decoder-only transformer (tied embedding, SwiGLU-free MLP)."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d_model), "norm": (d_model,)}
    for i in range(layers):
        shapes[f"layers.{i}.attn.qkv"] = (3 * d_model, d_model)
        shapes[f"layers.{i}.attn.out"] = (d_model, d_model)
        shapes[f"layers.{i}.mlp.up"] = (4 * d_model, d_model)
        shapes[f"layers.{i}.mlp.down"] = (d_model, 4 * d_model)
        shapes[f"layers.{i}.norm1"] = (d_model,)
        shapes[f"layers.{i}.norm2"] = (d_model,)
    return shapes


def _settings(
    poll: float, expect: int, leaders: list[str] | None = None, wire: str = "bf16"
) -> RoundSettings:
    return RoundSettings.of(
        DistributedConfig(
            relay_leaders=leaders or [],
            outer_lr=0.7,
            outer_momentum=0.9,
            round_timeout=600.0,
            poll_interval=poll,
            min_nodes=expect,
            drop_after=100,
            max_staleness=1,
            delta_dtype=wire,
        )
    )


def _retry() -> RetryPolicy:
    return RetryPolicy(initial=0.2, maximum=5.0, attempts=30, timeout=300.0)


# The top-level master, alone in a child process: its memory and CPU are measured there.
_MASTER = r"""
import json, re, sys, time
from pathlib import Path
import torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
from diloco_scale import _retry, _settings
from speedtronic.diloco.hub import HubClient
from speedtronic.diloco.master import RoundMaster
from speedtronic.retry import TransportError

cfg = json.loads(sys.argv[1])
def peak_kib():
    return int(re.search(r"VmHWM:\s*(\d+) kB", Path("/proc/self/status").read_text()).group(1))
hub = HubClient(cfg["repo"], token=cfg["token"], endpoint=cfg["endpoint"],
                cache_dir=cfg["cache"], retry=_retry())
hub.create_repo()
# the baseline: torch imported, its optimizer and the Hub client warmed up (torch.optim's first
# step imports ~800 modules, ~75 MiB, and the SDK its commit path, whatever the model), nothing
# of the model loaded yet
_p = torch.zeros(1)
_p.grad = torch.ones(1)
torch.optim.SGD([_p], lr=0.1, momentum=0.9, nesterov=True).step()
del _p
hub.commit({{"warmup.txt": b"warm"}}, message="warm up")
hub.read_bytes("warmup.txt")
hub.commit({{}}, ["warmup.txt"], message="warm up")
baseline_kib = peak_kib()
state = {{k: torch.zeros(v) for k, v in cfg["shapes"].items()}}
events = []
master = RoundMaster(hub, state,
                     settings=_settings(cfg["poll"], cfg["expect"], cfg["leaders"]),
                     state_dir=Path(cfg["state_dir"]),
                     emit=lambda e, **fields: events.append((e, fields)))
del state  # the master holds its own copy
master.reconcile()
idle = {{"peak_kib": peak_kib(), "cpu": time.process_time()}}
deadline = time.monotonic() + cfg["timeout"]
while not master.finished.is_set() and time.monotonic() < deadline:
    try:
        if master.poll_once():
            continue
    except TransportError:
        pass
    time.sleep(cfg["poll"])
rounds = [p for e, p in events if e == "outer_step"]
print(json.dumps({{
    "finished": master.finished.is_set(),
    "rounds": len(rounds),
    "included": [r["included"] for r in rounds],
    "reasons": [r["reason"] for r in rounds],
    "peak_kib": peak_kib(),
    "peak_kib_before_rounds": idle["peak_kib"],
    "baseline_kib": baseline_kib,
    "cpu_seconds_rounds": time.process_time() - idle["cpu"],
}}))
"""


class Watch:
    """Snapshots of the emulator's counters taken inside the commit that publishes each
    top-level global (exact: no request of the next round can slip in before them)."""

    def __init__(self, emulator: HubEmulator):
        self.emulator = emulator
        self.marks: list[tuple[int, float, dict[str, Any]]] = []
        self._last = -1

    def _on_commit(self, repo_id: str, files: dict[str, bytes]) -> None:
        data = files.get("global/step_count.json") if repo_id == TOP else None
        if data is None:
            return
        step = int(json.loads(data)["outer_step"])
        if step > self._last:
            self._last = step
            self.marks.append((step, time.monotonic(), self.emulator.stats()))

    def start(self) -> Watch:
        """Watch from now on."""
        self.emulator.on_commit = self._on_commit
        return self

    def stop(self) -> None:
        """Stop watching."""
        self.emulator.on_commit = None


def _node(
    transport: Any,
    node_id: str,
    rounds: int,
    shapes: dict[str, tuple[int, ...]],
    gate: threading.Semaphore,
    poll: float,
    failures: list[str],
    timeout: float,
    wire: str = "bf16",
    sizes: list[int] | None = None,
) -> None:
    """One simulated node: per round, wait for global r, download it, upload a seeded
    pseudo-gradient for round r in ``wire`` format (the last one with a ``done`` status);
    the size of each upload is appended to ``sizes``."""
    try:
        deadline = time.monotonic() + timeout
        transport.claim_owner(node_id, {"instance": f"{node_id}-1", "state": "training"})
        seed = sum(map(ord, node_id))
        for r in range(rounds):
            while True:
                meta = transport.global_metadata()
                if meta is not None and meta.outer_step >= r:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no global {r} within {timeout:.0f} s")
                time.sleep(poll)
            with gate:
                transport.read_global(meta)  # what a real node downloads every round
                gen = torch.Generator().manual_seed(seed * 1000 + r)
                delta = {k: torch.randn(v, generator=gen) * 1e-3 for k, v in shapes.items()}
                last = r == rounds - 1
                status = {"instance": f"{node_id}-1", "state": "done" if last else "training"}
                if last:
                    status["final_round"] = r
                transport.upload_delta(
                    delta,
                    node_id=node_id,
                    round_index=r,
                    local_step=r,
                    base_outer_step=r,
                    dtype=wire,
                    owner=status,
                    metadata={
                        "run_id": meta.run_id,
                        "instance": f"{node_id}-1",
                        "final": str(last).lower(),
                    },
                )
                if sizes is not None:
                    sizes.append(transport.last_upload_bytes)
                del delta
    except Exception as exc:  # reported, and the run counts as failed
        failures.append(f"{node_id}: {type(exc).__name__}: {exc}")


def _leader(
    tmp: Path, name: str, endpoint: str, shapes: dict, members: int, poll: float, wire: str
):
    exchange = DirectoryTransport(f"file://{tmp}/{name}", _retry())
    exchange.create_repo()
    top = HubClient(TOP, token=f"tok-{name}", endpoint=endpoint, cache_dir=tmp / "cache" / name,
                    retry=_retry())  # fmt: skip
    events: list = []
    stop = threading.Event()
    upstream = RelayStep(
        top,
        node_id=name,
        settings=_settings(poll, members, wire=wire),
        record=lambda **status: {"instance": f"{name}-1", **status},
        stop=stop,
    )
    master = RoundMaster(
        exchange,
        {k: torch.zeros(v) for k, v in shapes.items()},
        settings=_settings(poll, members, wire=wire),
        state_dir=tmp / f"state-{name}",
        emit=lambda e, **fields: events.append((e, fields)),
        outer=upstream,
    )
    master.events = events  # type: ignore[attr-defined]
    master.stop_relay = stop  # type: ignore[attr-defined]
    return master


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def simulate(
    k: int,
    layout: str,
    *,
    rounds: int,
    shapes: dict[str, tuple[int, ...]],
    group_size: int = 8,
    latency: tuple[float, float] = (0.05, 0.15),
    poll: float = 0.2,
    parallel: int = 8,
    timeout: float = 1800.0,
    budget: Budget | None = None,
    wire: str = "bf16",
) -> dict[str, Any]:
    """Run ``rounds`` rounds of ``k`` simulated nodes in ``layout``; the measured row.
    ``budget`` makes the emulator enforce Hub quotas (429 + Retry-After past them)."""
    tokens = ["tok-master", *(f"tok-n{i}" for i in range(k))]
    groups = math.ceil(k / group_size) if layout == "groups" else 0
    tokens += [f"tok-g{j}" for j in range(groups)]
    faults = FaultConfig(latency=latency[0], latency_jitter=latency[1], seed=7)
    emulator = HubEmulator(0, token=tokens[0], tokens=tokens, faults=faults, budget=budget)
    emulator.start()
    tmp = Path(tempfile.mkdtemp(prefix=f"diloco-scale-{layout}-{k}-"))
    failures: list[str] = []
    watch = Watch(emulator).start()
    config = {
        "repo": TOP,
        "token": "tok-master",
        "endpoint": emulator.url,
        "cache": str(tmp / "cache" / "master"),
        "shapes": {n: list(s) for n, s in shapes.items()},
        "poll": poll,
        "expect": groups or k,
        "leaders": [f"g{j}" for j in range(groups)],  # the group leaders' weights count
        "state_dir": str(tmp / "state-top"),
        "timeout": timeout,
    }
    HubClient(TOP, token="tok-master", endpoint=emulator.url, cache_dir=tmp / "cache" / "setup",
              retry=_retry()).create_repo()  # fmt: skip
    script = _MASTER.format(root=str(REPO), bench=str(REPO / "bench"))
    master = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(config)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    gate = threading.Semaphore(parallel)
    sizes: list[int] = []
    leaders = []
    threads = []
    started = time.monotonic()
    for i in range(k):
        node_id = f"n{i}"
        if layout == "groups":
            j = i // group_size
            if len(leaders) <= j:
                members = min(group_size, k - j * group_size)
                leaders.append(_leader(tmp, f"g{j}", emulator.url, shapes, members, poll, wire))
                leaders[-1].start()
            transport: Any = DirectoryTransport(f"file://{tmp}/g{j}", _retry())
        else:
            transport = HubClient(TOP, token=f"tok-n{i}", endpoint=emulator.url,
                                  cache_dir=tmp / "cache" / node_id, retry=_retry())  # fmt: skip
        thread = threading.Thread(
            target=_node,
            args=(transport, node_id, rounds, shapes, gate, poll, failures, timeout, wire, sizes),
            daemon=True,
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout)
    out, _ = master.communicate(timeout=timeout)
    elapsed = time.monotonic() - started
    for relay in leaders:
        relay.finished.wait(30)
        relay.stop_relay.set()
        relay.stop()
    watch.stop()
    stats = emulator.stats()
    emulator.stop()
    top = json.loads(out.strip().splitlines()[-1])

    # exactly once: every (node, round) in the round it was sent for, nowhere twice
    expected = collections.Counter((f"n{i}", r) for i in range(k) for r in range(rounds))
    seen: collections.Counter = collections.Counter()
    if layout == "groups":
        for relay in leaders:
            for e, p in relay.events:
                if e == "outer_step":
                    seen.update(tuple(x.split("/")) for x in p["included"])
        relayed = collections.Counter(tuple(x.split("/")) for row in top["included"] for x in row)
        relay_ok = relayed == collections.Counter(
            (f"g{j}", str(r)) for j in range(groups) for r in range(rounds)
        )
    else:
        seen.update(tuple(x.split("/")) for row in top["included"] for x in row)
        relay_ok = True
    seen = collections.Counter({(n, int(r)): c for (n, r), c in seen.items()})
    exact = seen == expected and relay_ok

    # per round, from the snapshots taken at each top-level publish (global 0 .. rounds)
    marks = {step: (t, s) for step, t, s in watch.marks}
    steady = [r for r in range(1, rounds + 1) if r in marks and r - 1 in marks]
    latencies = [marks[r][0] - marks[r - 1][0] for r in steady]

    def per_round(get) -> float:
        first, last = min(steady) - 1, max(steady)
        return (get(marks[last][1]) - get(marks[first][1])) / len(steady)

    def token(name: str):
        return lambda s: s["by_token"].get(token_tag(name), {}).get("requests", 0)

    def token_commits(name: str):
        return lambda s: s["by_token"].get(token_tag(name), {}).get("commits", 0)

    commits_repo = per_round(lambda s: s["commits_by_repo"].get(TOP, 0))
    requests_all = per_round(lambda s: sum(v["requests"] for v in s["by_token"].values()))
    hub_clients = ["tok-master"] + (
        [f"tok-g{j}" for j in range(groups)] if groups else [f"tok-n{i}" for i in range(k)]
    )
    per_token_requests = [per_round(token(t)) for t in hub_clients]
    per_token_commits = [per_round(token_commits(t)) for t in hub_clients]
    return {
        "layout": layout,
        "nodes": k,
        "delta_dtype": wire,
        "upload_bytes_per_node_per_round": statistics.mean(sizes) if sizes else None,
        "global_bytes_per_node_per_round": 4 * sum(math.prod(s) for s in shapes.values()),
        "groups": groups,
        "hub_clients": len(hub_clients),
        "parameters": sum(math.prod(s) for s in shapes.values()),
        "rounds": top["rounds"],
        "finished": top["finished"] and not failures,
        "failures": failures[:5],
        "exactly_once": exact,
        "round_latency_p50_s": _pct(latencies, 0.5) if latencies else None,
        "round_latency_p99_s": _pct(latencies, 0.99) if latencies else None,
        "hub_commits_per_round_repo": commits_repo,
        "hub_commits_per_round_max_token": max(per_token_commits),
        "hub_requests_per_round": requests_all,
        "hub_requests_per_round_max_token": max(per_token_requests),
        "master_peak_mib": top["peak_kib"] / 1024,
        "master_baseline_mib": top["baseline_kib"] / 1024,
        # the issue 22 figure: peak minus baseline over the fp32 model's bytes (target <= 3x)
        "master_peak_over_model": (top["peak_kib"] - top["baseline_kib"])
        * 1024
        / (4 * sum(math.prod(s) for s in shapes.values())),
        "master_peak_mib_before_rounds": top["peak_kib_before_rounds"] / 1024,
        "master_cpu_s_per_round": top["cpu_seconds_rounds"] / max(1, top["rounds"]),
        "rounds_per_hour_commit_budget_per_repo": HUB_COMMITS_PER_HOUR / commits_repo,
        "rounds_per_hour_commit_budget_shared_token": HUB_COMMITS_PER_HOUR / commits_repo,
        "rounds_per_hour_commit_budget_own_tokens": HUB_COMMITS_PER_HOUR / max(per_token_commits),
        "seconds": elapsed,
        "emulator_budget_refusals": stats["budget_refused"],
    }


def codec_cost(
    shapes: dict[str, tuple[int, ...]],
    wires: list[str],
    *,
    block_size: int,
    inner_steps: int,
    batch: int,
    seq: int,
    steps: int = 3,
) -> dict[str, Any]:
    """Seconds to quantize and to dequantize one pseudo-gradient of ``shapes`` per wire
    format, and the training time of one round (``inner_steps`` x the mean of ``steps``
    timed AdamW steps after one untimed step) of the reference transformer of that size."""
    from speedtronic.model import build_model

    torch.manual_seed(0)
    delta = {k: torch.randn(v) * 1e-3 for k, v in shapes.items()}
    costs: dict[str, dict[str, float]] = {}
    for wire in wires:
        encode_delta({"warm-up": torch.ones(1024)}, wire, block_size)  # first-call setup
        started = time.perf_counter()
        encoded = encode_delta(delta, wire, block_size)
        encode = time.perf_counter() - started
        started = time.perf_counter()
        for value in encoded.values():
            decode_value(value)
        decode = time.perf_counter() - started
        costs[wire] = {"quantize_s": encode, "dequantize_s": decode}
    embed = shapes["embed"]
    layers = sum(1 for name in shapes if name.endswith(".attn.qkv"))
    config = ModelConfig(
        vocab_size=embed[0], d_model=embed[1], n_layer=layers, n_head=8, max_seq_len=seq
    )
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, embed[0], (batch, seq + 1))
    times = []
    for i in range(steps + 1):
        started = time.perf_counter()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - started)
    step = statistics.mean(times)
    round_seconds = inner_steps * step
    for cost in costs.values():
        cost["ratio_to_round_training"] = (cost["quantize_s"] + cost["dequantize_s"]) / (
            round_seconds
        )
    return {
        "parameters": sum(math.prod(s) for s in shapes.values()),
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "train_step_s": step,
        "inner_steps": inner_steps,
        "tokens_per_step": batch * seq,
        "round_training_s": round_seconds,
        "block_size": block_size,
        "torch_threads": torch.get_num_threads(),
        "wires": costs,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the table; print one JSON row per layout and K, and write them to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--layouts", nargs="+", default=["direct", "groups"],
                        choices=["direct", "groups"])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--latency", type=float, nargs=2, default=[0.05, 0.15],
                        help="request latency: base seconds and uniform extra")  # fmt: skip
    parser.add_argument("--poll", type=float, default=0.2)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--delta-dtypes", nargs="+", default=["bf16"], choices=DELTA_FORMATS)
    parser.add_argument("--codec-cost", action="store_true")
    parser.add_argument("--inner-steps", type=int, default=500)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-seq", type=int, default=256)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    shapes = model_shapes(args.d_model, args.layers, args.vocab)
    cost = None
    if args.codec_cost:
        cost = codec_cost(
            shapes,
            [w for w in args.delta_dtypes if w != "fp32"] or ["int8"],
            block_size=DistributedConfig().delta_block_size,
            inner_steps=args.inner_steps,
            batch=args.train_batch,
            seq=args.train_seq,
        )
        print(json.dumps(cost), flush=True)
    rows = []
    for wire in args.delta_dtypes:
        for k in args.nodes:
            for layout in args.layouts:
                row = simulate(
                    k,
                    layout,
                    rounds=args.rounds,
                    shapes=shapes,
                    group_size=args.group_size,
                    latency=(args.latency[0], args.latency[1]),
                    poll=args.poll,
                    parallel=args.parallel,
                    wire=wire,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        result = {
            "benchmark": "diloco_scale",
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "settings": vars(args),
            "codec_cost": cost,
            "rows": rows,
            "p50_latency_by_layout": {
                layout: statistics.median(
                    r["round_latency_p50_s"] for r in rows if r["layout"] == layout
                )
                for layout in args.layouts
            },
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["finished"] and r["exactly_once"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
