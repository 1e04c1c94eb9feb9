"""Does DiLoCo train? K nodes against one node, the K x batch run and the exact arithmetic.

Corpus (``--corpus``): ``stdlib``, the running Python's standard library sources (``*.py``
outside site-packages, in path order, non-ASCII bytes dropped), one byte per token, the last 5%
held out (``eval.holdout: 0.05``); or ``markov``, the data module's learnable synthetic source
(``data.synthetic: markov``, a seeded sparse Markov chain over the 128 tokens, ``MARKOV_SAMPLES``
windows with 5% held out; its entropy rate is the best loss possible). Nothing is downloaded.
Model: the reference transformer, ~0.8M parameters, vocabulary 128; AdamW, batch 16, the same
number of steps per node in every row. Rows:

- ``1 node``: one trainer, batch B.
- ``1 node, K x batch``: one trainer, batch K*B (what synchronous data parallelism computes).
- ``ideal``: :func:`speedtronic.testing.diloco_ideal.simulate`, the exact DiLoCo arithmetic in one
  process with the real run's node ids (data streams), inner optimizer and outer settings.
- ``DiLoCo, K processes``: K ``speedtronic train`` processes started at once, as the README
  shows (a master that trains + K-1 workers) over a shared directory; every distributed setting
  comes from ``configs/diloco.yaml`` except the exchange, role, node id and ``inner_steps``.
  Scored: the master's ``final/`` global after the last round. ``--sync`` adds the same run
  with the other ``distributed.sync`` mode (the shipped one is the row the target applies to).

Then compressed pseudo-gradients (``distributed.delta_dtype``, issue 23): for every case of
``--deltas`` (``fp32``, ``bf16``, ``fp16``, ``int8``, ``int4``; ``-noef``: without error
feedback; ``@int8`` / ``@int4``: the global published as a quantized outer update,
``distributed.global_dtype``) an ideal row with the same wire formats and error feedback in
:func:`~speedtronic.testing.diloco_ideal.simulate`, and for every case of ``--real-deltas`` a
K-process row (error feedback on, as shipped), each with its bytes per round per node up and
down (ideal: the sizes of the files the formats write for this model, the download being the
full global or the update; K processes: the mean ``bytes`` of the ``delta_uploaded`` and
``global_pulled`` events of the round globals). ``--block-sizes`` adds the quantization error
of one real pseudo-gradient (node 0, first round) per block size, with its bytes. Targets of
issue 23: int8 with error feedback <= 1.01x the fp32 loss at <= 0.26x its bytes, int4 <= 1.02x
at <= 0.14x.

With ``--outer`` (cases as in :func:`parse_outer`), the run is instead the outer-step table
(issue 33): per ``--seeds`` seed the K x batch run, then every case's ideal row at every
``--outer-inner-steps``, with each round's eta and the bytes per round per node (the first
moments included); ``--real-outer`` adds each case as K processes, measured against its ideal
row (loss, largest weight difference, every round's eta, the bytes the events report).

Then a sweep of outer settings (and ``inner_steps``) on the ideal row. Target of issue 15: the
K-process global at most 0.96x the 1-node loss and at most 1.03x the ideal row.

    python bench/diloco_quality.py                  # ~25 min on 2 cores, without the sweep
    python bench/diloco_quality.py --sweep full     # + the outer-settings table (~45 min more)
    python bench/diloco_quality.py --steps 120 --sweep none   # a quick look
    python bench/diloco_quality.py --sweep none --sync blocking \
        --deltas fp32,bf16,bf16-noef,int8,int8-noef,int4,int4-noef --real-deltas int8,int4
    python bench/diloco_quality.py --steps 300 --sweep none --skip-single \
        --deltas fp32,fp32@int8,int8@int8,int8-noef@int8,int4@int4,int4-noef@int4
    python bench/diloco_quality.py --corpus markov --steps 300 --sweep none --skip-single \
        --deltas fp32,int8,int8-noef,int4,int4-noef,int8@int8,int4@int4
    python bench/diloco_quality.py --corpus markov --outer average,adaptive-fa2,adaptive-fa2-mom \
        --seeds 0 --real-outer
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from speedtronic.config import SpeedtronicConfig  # noqa: E402
from speedtronic.diloco.codec import (  # noqa: E402
    DELTA_FORMATS,
    compute_pseudo_gradient,
    cpu_state_dict,
    decode_value,
    delta_to_bytes,
    encode_delta,
    floating_state,
    load_safetensors,
    write_safetensors,
)
from speedtronic.diloco.master import OuterUpdate  # noqa: E402
from speedtronic.model import build_model  # noqa: E402
from speedtronic.testing.diloco_ideal import IdealResult, simulate  # noqa: E402
from speedtronic.train.evaluate import build_heldout, evaluate  # noqa: E402
from speedtronic.train.runtime import build_runtime  # noqa: E402

SWEEPS = {
    "none": [],
    "small": [(25, 1.0, 0.0), (25, 0.7, 0.9), (25, 1.0, 0.5)],
    "full": [
        (10, 1.0, 0.0),
        (10, 0.7, 0.9),
        (25, 1.0, 0.0),
        (25, 1.5, 0.0),
        (25, 1.0, 0.5),
        (25, 0.7, 0.9),
        (25, 0.5, 0.9),
        (25, 0.3, 0.9),
        (50, 1.0, 0.0),
        (50, 0.7, 0.9),
    ],
}


def build_corpus(path: Path) -> int:
    """Write the stdlib corpus as a uint16 token file (bytes < 128); returns its length."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks = []
    for file in files:
        data = np.frombuffer(file.read_bytes(), dtype=np.uint8)
        chunks.append(data[data < 128])
    tokens = np.concatenate(chunks).astype(np.uint16)
    tokens.tofile(path)
    return len(tokens)


MARKOV_SAMPLES = 200_000


def base_config(args: argparse.Namespace, corpus: Path | None) -> dict:
    """The bench's model/data/optimizer; distributed settings come from configs/diloco.yaml.
    ``corpus``: the stdlib token file, or None for the synthetic Markov source."""
    shipped = yaml.safe_load((ROOT / "configs" / "diloco.yaml").read_text())
    source = (
        {"token_path": str(corpus), "sampling": "random"}
        if corpus is not None
        else {"synthetic": "markov", "num_tokens": MARKOV_SAMPLES}
    )
    return {
        "name": "diloco-quality",
        "seed": 1234,
        "device": "cpu",
        "max_steps": args.steps,
        "model": {
            "vocab_size": 128,
            "max_seq_len": args.seq,
            "n_layer": 4,
            "n_head": 4,
            "d_model": 128,
        },
        "data": {
            **source,
            "micro_batch_size": args.batch,
            "target_batch_size": args.batch,
        },
        "eval": {"holdout": 0.05, "tokens": args.eval_tokens, "every_steps": 0},
        "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": 0.1},
        "scheduler": {"warmup_steps": args.warmup},
        "precision": "fp32",
        "checkpoint": {"enabled": True, "every_steps": 10_000, "keep_last": 1},
        "logging": {"level": "WARNING", "every_steps": 50},
        "distributed": dict(shipped["distributed"], inner_steps=args.inner_steps),
    }


def config_of(raw: dict) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict(copy.deepcopy(raw))


def score(config: SpeedtronicConfig, state: dict) -> float:
    model = build_model(config.model)
    model.load_state_dict(state, strict=False)
    return evaluate(model, build_heldout(config), device=torch.device("cpu")).loss


def run_single(raw: dict, batch: int) -> dict:
    raw = copy.deepcopy(raw)
    raw["distributed"]["enabled"] = False
    raw["checkpoint"]["enabled"] = False
    raw["data"]["target_batch_size"] = batch
    config = config_of(raw)
    started = time.perf_counter()
    trainer, _ = build_runtime(config)
    trainer.heldout = None
    trainer.fit()
    trainer.logger.close()
    loss = evaluate(trainer.model, build_heldout(config), device=torch.device("cpu")).loss
    return {"loss": loss, "seconds": time.perf_counter() - started}


def run_ideal(
    raw: dict,
    nodes: list[str],
    h: int,
    outer: dict | None = None,
    wire: str = "fp32",
    error_feedback: bool = True,
    global_wire: str = "fp32",
) -> dict:
    """The ideal row: ``raw``'s outer settings (those of configs/diloco.yaml, as the K
    processes run them), or ``outer`` (``simulate``'s outer keywords, a sweep row)."""
    config = config_of(raw)
    started = time.perf_counter()
    result = simulate(
        config,
        nodes,
        inner_steps=h,
        delta_dtype=wire,
        error_feedback=error_feedback,
        global_dtype=global_wire,
        **(outer or {}),
    )
    return {
        "loss": result.eval_loss,
        "rounds": result.outer_steps,
        "seconds": time.perf_counter() - started,
        "state": result.global_state,
    }


def run_real(
    raw: dict,
    nodes: list[str],
    work: Path,
    sync: str,
    wire: str = "fp32",
    glob: str = "fp32",
    settings: dict | None = None,
) -> dict:
    """K ``speedtronic train`` processes started at once; the master is nodes[0]; their
    contributions travel as ``wire`` (``distributed.delta_dtype``), the globals as ``glob``
    (``distributed.global_dtype``); ``settings``: more ``distributed`` keys (an outer case)."""
    exchange = work / "exchange"
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    started = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("SPEEDTRONIC_CONFIG", None)
    for index, node in enumerate(nodes):
        node_raw = copy.deepcopy(raw)
        out = work / node
        node_raw["output_dir"] = str(out)
        node_raw["logging"]["json_file"] = str(out / "events.jsonl")
        node_raw["distributed"].update(
            enabled=True,
            repo_id=f"file://{exchange}",
            role="master" if index == 0 else "worker",
            node_id=node,
            sync=sync,
            delta_dtype=wire,
            global_dtype=glob,
        )
        node_raw["distributed"].update(settings or {})
        path = work / f"{node}.yaml"
        path.write_text(yaml.safe_dump(node_raw))
        log = open(work / f"{node}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "speedtronic", "train", "--config", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=work,
                ),
                log,
            )
        )
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    seconds = time.perf_counter() - started
    if any(codes):
        raise RuntimeError(f"node exit codes {codes}; see the logs in {work}")
    events = [
        record
        for node in nodes
        for record in map(json.loads, (work / node / "events.jsonl").read_text().splitlines())
    ]
    waits = [r["seconds"] for r in events if r.get("event") == "sync_wait"]
    uploads = [r["bytes"] for r in events if r.get("event") == "delta_uploaded"]
    pulled = [  # a round's global (global 0, every worker's first, is not a round's)
        r
        for r in events
        if r.get("event") == "global_pulled" and r.get("source") != "local" and r["outer_step"]
    ]
    downloads = [r["bytes"] for r in pulled]
    rounds = [
        record
        for record in map(json.loads, (work / nodes[0] / "events.jsonl").read_text().splitlines())
        if record.get("event") == "outer_step"
    ]
    state = load_safetensors(work / nodes[0] / "final" / "model.safetensors")
    reasons: dict[str, int] = {}
    for record in rounds:
        reason = record.get("reason", "?")
        reasons[reason] = reasons.get(reason, 0) + 1
    return {
        "loss": score(config_of(raw), state),
        "seconds": seconds,
        "rounds": len(rounds),
        "close_reasons": reasons,
        "etas": [float(r.get("eta", 1.0)) for r in rounds],
        "late": sum(int(r.get("deltas_late", 0)) for r in rounds),
        "sync_wait_seconds_per_node": sum(waits) / len(nodes),
        "stale": sum(int(r.get("deltas_stale", 0)) for r in rounds),
        "delta_dtype": wire,
        "global_dtype": glob,
        "upload_bytes_per_round_per_node": sum(uploads) / max(len(uploads), 1),
        "download_bytes_per_round_per_node": sum(downloads) / max(len(downloads), 1),
        "globals_by_source": {
            how: sum(r.get("source") == how for r in pulled) for how in ("full", "update")
        },
        "bytes_per_round_per_node": sum(uploads) / max(len(uploads), 1)
        + sum(downloads) / max(len(downloads), 1),
        "state": state,
    }


def parse_outer(case: str) -> dict:
    """An outer-step case: ``-``-separated, the outer step first (``average``, ``nesterov``,
    ``adaptive``), then any of ``c0.75`` (adaptive_c), ``max2`` (adaptive_max), ``fa2``
    (final_average), ``mom`` (the first moment averaged every round) or ``mom2`` (every 2nd),
    ``int8``/``int4``/``bf16`` (delta_dtype). ``nesterov`` is 0.7/0.9 unless ``lr0.5`` /
    ``m0.5`` say otherwise."""
    step, *options = case.split("-")
    if step not in ("average", "nesterov", "adaptive"):
        raise SystemExit(f"unknown outer case {case!r}: starts with average, nesterov, adaptive")
    settings: dict = {"outer_step": step}
    if step == "nesterov":
        settings.update(outer_lr=0.7, outer_momentum=0.9)
    for option in options:
        if option in DELTA_FORMATS:
            settings["delta_dtype"] = option
        elif option == "mom":
            settings["sync_inner_momentum"] = "every_round"
        elif option.startswith("mom") and option[3:].isdigit():
            settings.update(sync_inner_momentum="every_n", inner_momentum_every=int(option[3:]))
        elif option.startswith("fa") and option[2:].isdigit():
            settings["final_average"] = int(option[2:])
        elif option.startswith("max"):
            settings["adaptive_max"] = float(option[3:])
        elif option.startswith("lr"):
            settings["outer_lr"] = float(option[2:])
        elif option.startswith("m"):
            settings["outer_momentum"] = float(option[1:])
        elif option.startswith("c"):
            settings["adaptive_c"] = float(option[1:])
        else:
            raise SystemExit(f"unknown option {option!r} in outer case {case!r}")
    return settings


def _sized(
    config: SpeedtronicConfig, tensors: dict[str, torch.Tensor], wire: str, block_size: int
) -> int:
    """Bytes of ``tensors`` written as a contribution file in ``wire``, with a node's header."""
    extra = {"final": "false", "run_id": "0" * 32, "instance": "0" * 16}
    data = delta_to_bytes(
        tensors,
        node_id="node-0",
        local_step=config.effective_max_steps,
        base_outer_step=99,
        dtype=wire,
        block_size=block_size,
        extra=extra,
    )
    return len(data)


def momentum_bytes(config: SpeedtronicConfig, wire: str, block_size: int) -> int:
    """One first-moment file of this model (every trainable parameter) in ``wire``, with the
    header a contribution carries: what a node uploads and downloads in a syncing round."""
    model = build_model(config.model)
    moments = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    return _sized(config, moments, wire, block_size)


def outer_rows(
    raw: dict,
    nodes: list[str],
    args: argparse.Namespace,
    work: Path,
    save: Callable[[list[dict]], None],
) -> list[dict]:
    """For every seed: the K x batch run, then the ideal row of every ``--outer`` case at every
    ``--outer-inner-steps``, with its loss against the K x batch run, the eta of each round and
    the bytes a node moves per round (the first moment included), and with ``--real-outer`` the
    same case in K processes under ``work``; ``save(rows)`` after each."""
    rows = []
    cases = [c for c in args.outer.split(",") if c]
    steps = [int(h) for h in (args.outer_inner_steps or str(args.inner_steps)).split(",")]
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        seeded = dict(copy.deepcopy(raw), seed=seed)
        batch = None
        if not args.skip_batch:
            batch = run_single(seeded, args.batch * args.nodes)
            print(f"  seed {seed} 1 node, K x batch: {batch['loss']:.4f}", flush=True)
            rows.append({"seed": seed, "case": "1 node, K x batch", **batch})
        for h in steps:
            for case in cases:
                settings = parse_outer(case)
                config = config_of(seeded)
                started = time.perf_counter()
                result = simulate(config, nodes, inner_steps=h, **settings)
                wire = settings.get("delta_dtype", config.distributed.delta_dtype)
                block = config.distributed.delta_block_size
                moment = momentum_bytes(config, wire, block) * result.momentum_syncs
                up = file_bytes(config, wire, block) + moment / result.outer_steps
                down = download_bytes(config, "fp32", block) + moment / result.outer_steps
                row = {
                    "seed": seed,
                    "case": case,
                    "inner_steps": h,
                    "settings": settings,
                    "loss": result.eval_loss,
                    "x_batch": result.eval_loss / batch["loss"] if batch else None,
                    "etas": result.etas,
                    "momentum_syncs": result.momentum_syncs,
                    "rounds": result.outer_steps,
                    "upload_bytes_per_round_per_node": up,
                    "download_bytes_per_round_per_node": down,
                    "seconds": time.perf_counter() - started,
                }
                rows.append(row)
                save(rows)
                ratio = f" x batch {row['x_batch']:.4f}" if batch else ""
                print(
                    f"  seed {seed} H={h} {case}: {row['loss']:.4f}{ratio} eta "
                    f"{min(result.etas):.3f}-{max(result.etas):.3f} ({row['seconds']:.0f} s)",
                    flush=True,
                )
                if args.real_outer:
                    rows.append(real_outer_row(seeded, nodes, work, row, result, batch))
                    save(rows)
    return rows


def real_outer_row(
    raw: dict, nodes: list[str], work: Path, ideal: dict, result: IdealResult, batch: dict | None
) -> dict:
    """The K-process run of the outer case of ``ideal`` (its settings, seed and
    ``inner_steps``), measured against that ideal row: loss, the largest weight difference,
    every round's eta, and the bytes the nodes' events say they moved."""
    seeded = copy.deepcopy(raw)
    settings = dict(ideal["settings"], inner_steps=ideal["inner_steps"])
    wire = settings.pop("delta_dtype", seeded["distributed"].get("delta_dtype", "fp32"))
    name = f"real-{ideal['case']}-h{ideal['inner_steps']}-s{ideal['seed']}"
    real = run_real(seeded, nodes, work / name, "blocking", wire, settings=settings)
    state = real.pop("state")
    etas = real["etas"]
    row = {
        "seed": ideal["seed"],
        "case": f"K processes {ideal['case']}",
        "inner_steps": ideal["inner_steps"],
        "settings": ideal["settings"],
        **real,
        "x_batch": real["loss"] / batch["loss"] if batch else None,
        "x_ideal": real["loss"] / ideal["loss"],
        "max_abs_diff_vs_ideal": max(
            (state[k].float() - result.global_state[k].float()).abs().max().item()
            for k in result.global_state
        ),
        "max_eta_diff_vs_ideal": max(
            (abs(a - b) for a, b in zip(etas, result.etas, strict=False)), default=0.0
        )
        if len(etas) == len(result.etas)
        else None,
    }
    print(
        f"  K processes {ideal['case']}: {row['loss']:.4f} x ideal {row['x_ideal']:.4f}, max "
        f"|weight - ideal| {row['max_abs_diff_vs_ideal']:.2e}, max |eta - ideal| "
        f"{row['max_eta_diff_vs_ideal']}, rounds {row['rounds']} {row['close_reasons']}, up "
        f"{row['upload_bytes_per_round_per_node']:,.0f} / down "
        f"{row['download_bytes_per_round_per_node']:,.0f} bytes per round per node "
        f"({row['seconds']:.0f} s)",
        flush=True,
    )
    return row


def parse_case(case: str) -> tuple[str, bool, str]:
    """``int8`` -> (``int8``, error feedback on, fp32 global); ``int8-noef`` -> (``int8``,
    off, fp32); ``int8@int8`` -> (``int8``, on, the global as an int8 outer update)."""
    head, _, glob = case.partition("@")
    wire, _, suffix = head.partition("-")
    glob = glob or "fp32"
    if wire not in DELTA_FORMATS or suffix not in ("", "noef") or glob not in GLOBAL_FORMATS:
        raise SystemExit(
            f"unknown delta case {case!r}: a delta_dtype, optionally with -noef, optionally "
            f"with @ and a global_dtype ({', '.join(GLOBAL_FORMATS)})"
        )
    return wire, suffix != "noef", glob


GLOBAL_FORMATS = ("fp32", "int8", "int4")


def download_bytes(config: SpeedtronicConfig, wire: str, block_size: int) -> int:
    """What a node that holds the last global downloads per round: the full global file
    (fp32) or the quantized outer update (int8, int4), with the headers the master writes."""
    state = build_model(config.model).state_dict()
    buffer = io.BytesIO()
    if wire == "fp32":
        header = {"outer_step": 99, "run_id": "0" * 32, "final": False}
        write_safetensors(buffer, state, metadata=header)
        return len(buffer.getvalue())
    zeros = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in state.items()}
    encoded = encode_delta(zeros, wire, block_size)
    update = OuterUpdate(encoded, wire, block_size, 98, "0" * 64, 99, "0" * 64, "0" * 32)
    update.write(buffer)
    return len(buffer.getvalue())


def file_bytes(config: SpeedtronicConfig, wire: str, block_size: int) -> int:
    """The size of one contribution file of this model in ``wire`` format (with the header a
    node writes); it does not depend on the values."""
    model = build_model(config.model)
    delta = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in model.state_dict().items()}
    return _sized(config, delta, wire, block_size)


def block_errors(raw: dict, sizes: list[int]) -> list[dict]:
    """Relative L2 error and bytes (x fp32) of int8/int4 per block size on node 0's first
    pseudo-gradient (``inner_steps`` steps from the initial weights)."""
    raw = copy.deepcopy(raw)
    raw["distributed"]["enabled"] = False
    raw["checkpoint"]["enabled"] = False
    config = config_of(raw)
    trainer, _ = build_runtime(config, node_id="node-0")
    trainer.heldout = None
    before = floating_state(cpu_state_dict(trainer.model.state_dict()))
    trainer.fit(raw["distributed"]["inner_steps"])
    trainer.logger.close()
    delta = compute_pseudo_gradient(before, cpu_state_dict(trainer.model.state_dict()))
    norm = sum(float(v.pow(2).sum()) for v in delta.values()) ** 0.5
    fp32 = file_bytes(config, "fp32", 128)
    rows = []
    for wire in ("int8", "int4"):
        for size in sizes:
            encoded = encode_delta(delta, wire, size)
            error = sum(
                float((v - decode_value(encoded[k])).pow(2).sum()) for k, v in delta.items()
            )
            rows.append(
                {
                    "delta_dtype": wire,
                    "block_size": size,
                    "relative_error": error**0.5 / norm,
                    "bytes_vs_fp32": file_bytes(config, wire, size) / fp32,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per node")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--corpus", choices=("stdlib", "markov"), default="stdlib")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), default="small")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument(
        "--skip-single", action="store_true", help="no 1-node rows (a run of cases only)"
    )
    parser.add_argument(
        "--deltas",
        default="",
        help="ideal rows per wire format, e.g. fp32,bf16,int8,int8-noef,int4,int4-noef",
    )
    parser.add_argument(
        "--real-deltas", default="", help="K-process rows per wire format (error feedback on)"
    )
    parser.add_argument(
        "--block-sizes", default="", help="quantization error per block size, e.g. 32,64,128"
    )
    parser.add_argument(
        "--sync", default="blocking,overlapped", help="sync modes of the K-process rows"
    )
    parser.add_argument(
        "--outer",
        default="",
        help="outer-step cases on the ideal row only (no other rows), e.g. "
        "average,adaptive,adaptive-fa2,adaptive-fa2-mom,adaptive-fa2-mom2,nesterov,"
        "adaptive-fa2-int8 (see parse_outer)",
    )
    parser.add_argument(
        "--real-outer",
        action="store_true",
        help="each --outer case also as K processes, measured against its ideal row",
    )
    parser.add_argument("--seeds", default="1234", help="run.seed of each --outer run")
    parser.add_argument(
        "--outer-inner-steps", default="", help="inner_steps of the --outer runs (default: H)"
    )
    parser.add_argument(
        "--skip-batch", action="store_true", help="--outer without the K x batch run"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "diloco_quality.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each real process (OMP_NUM_THREADS=1): same arithmetic
    nodes = [f"node-{i}" for i in range(args.nodes)]
    with tempfile.TemporaryDirectory(prefix="speedtronic-quality-") as tmp:
        work = Path(tmp)
        if args.corpus == "stdlib":
            n_tokens = build_corpus(work / "corpus.bin")
            raw = base_config(args, work / "corpus.bin")
        else:
            n_tokens = MARKOV_SAMPLES * args.seq
            raw = base_config(args, None)
        dist = raw["distributed"]
        shipped_outer = config_of(raw).distributed
        print(
            f"corpus {n_tokens:,} tokens; {args.nodes} nodes x {args.steps} steps, batch "
            f"{args.batch}, inner_steps {args.inner_steps}, outer {shipped_outer.outer_step} "
            f"{shipped_outer.outer_lr}/{shipped_outer.outer_momentum} final_average "
            f"{shipped_outer.final_average}, sync "
            f"{dist.get('sync', 'blocking')}",
            flush=True,
        )
        if args.outer:
            outer_rows(
                raw,
                nodes,
                args,
                work,
                lambda done: _write(args, n_tokens, raw, {}, [], {}, {}, [], done),
            )
            return
        rows: dict[str, dict] = {}
        blocks = block_errors(raw, [int(b) for b in args.block_sizes.split(",") if b])
        for row in blocks:
            print(f"  block size: {row}", flush=True)
        if not args.skip_single:
            rows["1 node"] = run_single(raw, args.batch)
            print(f"  1 node: {rows['1 node']['loss']:.4f}", flush=True)
            rows["1 node, K x batch"] = run_single(raw, args.batch * args.nodes)
            print(f"  1 node, K x batch: {rows['1 node, K x batch']['loss']:.4f}", flush=True)
            rows["ideal"] = run_ideal(raw, nodes, args.inner_steps)
            print(f"  ideal: {rows['ideal']['loss']:.4f}", flush=True)
        config = config_of(raw)
        block = config.distributed.delta_block_size
        compressed: dict[str, dict] = {}
        ideal_states: dict[str, dict] = {}
        for case in [c for c in args.deltas.split(",") if c]:
            wire, feedback, glob = parse_case(case)
            row = run_ideal(raw, nodes, args.inner_steps, None, wire, feedback, glob)
            state = row.pop("state")
            if feedback:
                ideal_states[f"{wire}@{glob}"] = state
            row.update(
                kind="ideal",
                delta_dtype=wire,
                error_feedback=feedback,
                global_dtype=glob,
                block_size=block,
                upload_bytes_per_round_per_node=file_bytes(config, wire, block),
                download_bytes_per_round_per_node=download_bytes(config, glob, block),
            )
            row["bytes_per_round_per_node"] = (
                row["upload_bytes_per_round_per_node"] + row["download_bytes_per_round_per_node"]
            )
            compressed[f"ideal {case}"] = row
            print(f"  ideal {case}: {row['loss']:.4f}", flush=True)
        for case in [c for c in args.real_deltas.split(",") if c]:
            wire, _, glob = parse_case(case)
            row = run_real(raw, nodes, work / f"real-{wire}-{glob}", "blocking", wire, glob)
            ideal_state = ideal_states.get(f"{wire}@{glob}")
            if ideal_state is not None:  # the same format's ideal row ran in this process
                row["max_abs_diff_vs_ideal"] = max(
                    (row["state"][k].float() - ideal_state[k].float()).abs().max().item()
                    for k in ideal_state
                )
            row.pop("state")
            row.update(kind="K processes", error_feedback=True, block_size=block)
            compressed[f"K processes {case}"] = row
            print(f"  K processes {case}: {row['loss']:.4f}", flush=True)
        shipped = dist.get("sync", "blocking")
        skip = args.skip_real or args.skip_single  # these rows are measured against "ideal"
        modes = [] if skip else [m for m in args.sync.split(",") if m]
        for mode in sorted(modes, key=lambda m: m != shipped):  # the shipped mode first
            name = "DiLoCo, K processes" + ("" if mode == shipped else f" ({mode})")
            rows[name] = real = run_real(raw, nodes, work / f"real-{mode}", mode)
            ideal_state = rows["ideal"]["state"]
            real["sync"] = mode
            real["max_abs_diff_vs_ideal"] = max(
                (real["state"][k].float() - ideal_state[k].float()).abs().max().item()
                for k in ideal_state
            )
            print(f"  real ({mode}): {real['loss']:.4f}", flush=True)
        sweep = []
        for h, lr, momentum in SWEEPS[args.sweep]:
            result = run_ideal(raw, nodes, h, {"outer_lr": lr, "outer_momentum": momentum})
            sweep.append(
                {
                    "inner_steps": h,
                    "outer_lr": lr,
                    "outer_momentum": momentum,
                    "loss": result["loss"],
                    "seconds": result["seconds"],
                }
            )
            print(f"  sweep H={h} lr={lr} mom={momentum}: {result['loss']:.4f}", flush=True)
    if compressed:
        head = f"{'wire format (delta@global)':<32}{'held-out loss':>14}"
        print(f"\n{head}{'up/round/node':>15}{'down/round/node':>17}{'both':>12}")
        for name, row in compressed.items():
            print(
                f"{name:<32}{row['loss']:>14.4f}{row['upload_bytes_per_round_per_node']:>15.0f}"
                f"{row['download_bytes_per_round_per_node']:>17.0f}"
                f"{row['bytes_per_round_per_node']:>12.0f}"
            )
    if blocks:
        print(f"\n{'format':<8}{'block':>8}{'rel. error':>12}{'x fp32 bytes':>14}")
        for row in blocks:
            print(
                f"{row['delta_dtype']:<8}{row['block_size']:>8}{row['relative_error']:>12.4f}"
                f"{row['bytes_vs_fp32']:>14.4f}"
            )
    if "1 node" not in rows:
        _write(args, n_tokens, raw, rows, [], {}, compressed, blocks)
        return
    single = rows["1 node"]["loss"]
    print(f"\n{'run':<38}{'held-out loss':>14}{'x 1 node':>10}{'x ideal':>9}{'seconds':>9}")
    for name, row in rows.items():
        ratio = row["loss"] / rows["ideal"]["loss"]
        print(
            f"{name:<38}{row['loss']:>14.4f}{row['loss'] / single:>10.3f}{ratio:>9.3f}"
            f"{row['seconds']:>9.0f}"
        )
    verdict = {}
    if "DiLoCo, K processes" in rows:
        real = rows["DiLoCo, K processes"]
        verdict = {
            "real_vs_single": real["loss"] / single,
            "real_vs_ideal": real["loss"] / rows["ideal"]["loss"],
            "target_met": real["loss"] <= 0.96 * single
            and real["loss"] <= 1.03 * rows["ideal"]["loss"],
        }
        print(
            f"\nK processes / 1 node = {verdict['real_vs_single']:.3f} (target <= 0.96); "
            f"/ ideal = {verdict['real_vs_ideal']:.4f} (target <= 1.03); rounds "
            f"{real['rounds']} {real['close_reasons']}, late {real['late']}, stale "
            f"{real['stale']}, max |real - ideal| weight {real['max_abs_diff_vs_ideal']:.2e}"
        )
        for name, row in rows.items():
            if "sync_wait_seconds_per_node" in row:
                print(
                    f"{name}: each node waited {row['sync_wait_seconds_per_node']:.1f} s of "
                    f"{row['seconds']:.0f} s for globals"
                )
    if sweep:
        head = ("inner_steps", "outer lr", "momentum", "ideal loss", "x 1 node")
        print("\n" + "".join(f"{h:>12}" for h in head))
        for row in sweep:
            print(
                f"{row['inner_steps']:>12}{row['outer_lr']:>12}{row['outer_momentum']:>12}"
                f"{row['loss']:>12.4f}{row['loss'] / single:>12.3f}"
            )
    _write(args, n_tokens, raw, rows, sweep, verdict, compressed, blocks)


def _write(
    args: argparse.Namespace,
    n_tokens: int,
    raw: dict,
    rows: dict,
    sweep: list,
    verdict: dict,
    compressed: dict,
    blocks: list,
    outer: list | None = None,
) -> None:
    for row in rows.values():
        row.pop("state", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "machine": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "cpus": os.cpu_count(),
                },
                "corpus_tokens": n_tokens,
                "distributed": {k: v for k, v in raw["distributed"].items() if k != "token"},
                "rows": rows,
                "sweep": sweep,
                "verdict": verdict,
                "compressed": compressed,
                "block_sizes": blocks,
                "outer": outer or [],
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
