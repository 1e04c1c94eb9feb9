"""DiLoCo across a slow link, with real parts (issue 38, item 3).

K ``speedtronic train`` processes (a master that trains + K-1 workers) meet through the
project's Hub emulator (``distributed.repo_id: owner/name``, ``HF_ENDPOINT``), each node in a
network namespace of its own, joined to the Hub's namespace by a veth pair shaped with
``tc qdisc ... tbf`` (per-node links: the upload rate on the node's end, the download rate on
the Hub's end; see ``bench/link_net.py``). ``--latency-ms`` adds one-way latency with a relay
in the Hub's namespace (each chunk waits that long, both ways; throughput is not limited).

First the unshaped runs (the same processes, no tc; blocking, per wire dtype) give a round's
compute time, the bytes on the busiest link direction and the unshaped wall. Then the shaped
cases: ``sync`` blocking and overlapped x ``delta_dtype`` = ``global_dtype`` fp32 and int8 x two
link speeds, computed so that the busiest link direction's traffic of a round of the
``--calibrate-dtype`` run takes ``--fractions`` (30% and 100%) of a round's compute
(``--rates`` overrides them). Per node: compute seconds (time in inner steps), seconds on the
exchange (start, round boundaries, end; ``sync_wait`` events), utilization (compute / wall),
bytes up and down per round (veth counters: on the wire; the emulator's request log: HTTP
bodies, by kind of request; the events' ``bytes``), rounds. Per case: utilization (unshaped
wall / wall), the final global's held-out loss (the master's evals of each global) and its
ratio to blocking's, the wall to a target loss, and where a round's exchange time goes. A
recommendation line closes the table. Definitions: ``bench/link_report.py``.

Without root, ``ip netns`` or ``tc`` it prints one ``skip:`` line and exits 0.

    python bench/diloco_link.py                      # the issue's table (~20 min on 2 cores)
    python bench/diloco_link.py --rates 60,18        # fixed link speeds (Mbit/s)
    python bench/diloco_link.py --cases fast:int8:overlapped,slow:int8:overlapped
    python bench/diloco_link.py --cases slow:int8:blocking,slow:int8:overlapped:20:4
                                        # overlap_steps 20, 4 fragments (several rounds in flight)
    python bench/diloco_link.py --latency-ms 20 --set distributed.outer_step=adaptive
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import link_report as R  # noqa: E402
import link_tables as T  # noqa: E402
from link_net import LinkLab, cpu_seconds, support_problem  # noqa: E402

TOKEN = "hf_linkbench_token_not_a_secret"
SYNCS = ("blocking", "overlapped")
DTYPES = ("fp32", "int8")
LINKS = ("fast", "slow")
UNSHAPED = "unshaped"  # a case LINK that runs only the unshaped processes (no tc, no shaped case)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3, help="K: a master that trains + K-1 workers")
    p.add_argument("--steps", type=int, default=120, help="run.max_steps per node")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=32, help="model.max_seq_len")
    p.add_argument("--batch", type=int, default=4, help="samples per step")
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=2048,
        help="held-out tokens the master scores each global with (on its round thread)",
    )
    p.add_argument(
        "--final-eval-tokens",
        type=int,
        default=8192,
        help="held-out tokens the final global is scored with, after the run (0: "
        "the master's eval of the last global)",
    )
    p.add_argument(
        "--cases",
        default=",".join(f"{link}:{d}:{s}" for link in LINKS for d in DTYPES for s in SYNCS),
        help="shaped cases LINK:DTYPE:SYNC (link fast|slow), comma separated",
    )
    p.add_argument("--rates", default=None, help="FAST,SLOW in Mbit/s (default: calibrated)")
    p.add_argument("--fractions", default="0.3,1.0", help="traffic / compute of FAST,SLOW")
    p.add_argument("--calibrate-dtype", default="int8", choices=DTYPES)
    p.add_argument("--latency-ms", type=float, default=0.0, help="added one-way latency")
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="default: the unshaped fp32 run's final loss x 1.02",
    )
    p.add_argument("--quality-tolerance", type=float, default=0.02)
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more override for every node (repeatable)",
    )
    p.add_argument("--case-timeout", type=float, default=900.0)
    p.add_argument("--work", type=Path, default=None, help="logs (default: a temp folder)")
    p.add_argument(
        "--from-work",
        type=Path,
        default=None,
        help="analyse the runs kept in this --work folder again, run nothing",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/diloco_link.json")
    return p.parse_args(argv)


def shaped_cases(text: str) -> list[dict]:
    """``LINK:DTYPE:SYNC[:OVERLAP_STEPS[:FRAGMENTS]],...`` as case records (LINK ``unshaped``:
    that run alone, no tc; OVERLAP_STEPS and FRAGMENTS, overlapped only, override the config's
    ``distributed.overlap_steps`` and ``distributed.fragments``)."""
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        link, dtype, sync, *extra = item.split(":")
        fine = link in (*LINKS, UNSHAPED) and dtype in DTYPES and sync in SYNCS
        fine = fine and len(extra) <= 2 and all(x.isdigit() and int(x) > 0 for x in extra)
        if not fine or (extra and sync != "overlapped"):
            raise SystemExit(
                f"--cases: {item!r} is not LINK:DTYPE:SYNC[:OVERLAP_STEPS[:FRAGMENTS]] "
                f"({(*LINKS, UNSHAPED)}, {DTYPES}, {SYNCS}; the two counts positive, "
                "overlapped only)"
            )
        overlap, fragments = (int(x) for x in [*extra, "0", "0"][:2])
        name = f"{link}-{dtype}-{sync}"
        name += f"-o{overlap}" if overlap else ""
        name += f"-f{fragments}" if fragments else ""
        case = {"name": name, "link": link, "dtype": dtype, "sync": sync}
        cases.append(case | {"overlap_steps": overlap, "fragments": fragments})
    return cases


def node_sets(args: argparse.Namespace, case: dict, role: str, node: str, out: Path) -> list[str]:
    """The ``--set`` overrides of one node over configs/diloco.yaml."""
    return [
        f"run.max_steps={args.steps}",
        "run.seed=1",
        "run.device=cpu",
        f"model.vocab_size={args.vocab}",
        f"model.max_seq_len={args.seq}",
        f"model.n_layer={args.layers}",
        f"model.n_head={args.heads}",
        f"model.n_kv_head={args.kv_heads}",
        f"model.d_model={args.d_model}",
        "data.synthetic=markov",
        f"data.micro_batch_size={args.batch}",
        f"data.target_batch_size={args.batch}",
        "eval.holdout=0.05",
        f"eval.tokens={args.eval_tokens}",
        "eval.every_steps=0",  # the master scores every global; no local evals in the rounds
        "optimizer.lr=1e-3",
        "scheduler.warmup_steps=10",
        f"checkpoint.every_steps={10 * args.steps}",  # none inside the run
        "logging.every_steps=1",
        "logging.format=json",
        f"logging.json_file={out / 'events.jsonl'}",
        f"distributed.role={role}",
        f"distributed.node_id={node}",
        f"distributed.repo_id=linkbench/{case['name']}",
        f"distributed.sync={case['sync']}",
        f"distributed.delta_dtype={case['dtype']}",
        f"distributed.global_dtype={case['dtype']}",
        f"distributed.inner_steps={args.inner_steps}",
        *(
            f"distributed.{key}={case[key]}"
            for key in ("overlap_steps", "fragments")
            if case.get(key)
        ),
        f"distributed.expected_nodes={args.nodes}",
        f"distributed.poll_interval={args.poll_interval}",
        "distributed.round_timeout=600",  # the link, not the timeout policy, is measured
        "distributed.request_timeout=120",
        "distributed.retry_initial=0.2",
        "distributed.retry_max=2",
        "distributed.retry_attempts=8",
        f"distributed.cache_dir={out / 'hubcache'}",
        f"distributed.state_dir={out / 'state'}",
        *args.sets,
    ]


def node_env(port: int) -> dict[str, str]:
    """The environment of every node: one thread, this tree, the emulator through the node's
    forwarder on its loopback, the bench's token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        HF_TOKEN=TOKEN,
        HF_ENDPOINT=f"http://127.0.0.1:{port}",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return env


def run_case(
    lab: LinkLab, args: argparse.Namespace, case: dict, rate_bps: float | None, work: Path
) -> dict:
    """One run: shape (or not), start the emulator, the relays and the K nodes, wait for them;
    the raw material of :func:`analyse` (also kept as ``raw.json`` for ``--from-work``)."""
    folder = work / case["name"]
    folder.mkdir(parents=True, exist_ok=True)
    lab.shape(rate_bps, rate_bps)
    delay = args.latency_ms if rate_bps is not None else 0.0
    port, helpers = lab.open_hub(folder, TOKEN, delay)
    env = node_env(port)
    names = ["master"] + [f"worker-{i}" for i in range(1, args.nodes)]
    train = [
        sys.executable,
        "-m",
        "speedtronic",
        "train",
        "--config",
        str(ROOT / "configs/diloco.yaml"),
    ]
    before = lab.counters()
    started = time.time()
    nodes = []
    for i, name in enumerate(names):
        out = folder / name
        out.mkdir(exist_ok=True)
        sets = node_sets(args, case, "master" if i == 0 else "worker", name, out)
        argv = [*train, "--output-dir", str(out), *[x for s in sets for x in ("--set", s)]]
        mine = dict(env, HF_HOME=str(out / "hf"))
        nodes.append(lab.start(lab.nodes[i], name, argv, folder / f"{name}.out", env=mine, cwd=out))
    cpu: dict[str, float] = {}
    watched = [*zip(names, nodes, strict=True), *((h.name, h) for h in helpers)]
    codes = _wait_nodes(lab, nodes, args.case_timeout, lambda: _sample_cpu(watched, cpu))
    seconds = time.time() - started
    after = lab.counters()
    _sample_cpu(watched, cpu)
    for helper in helpers:
        lab.stop(helper)
    wire = {
        name: [after[i][0] - before[i][0], after[i][1] - before[i][1]]
        for i, name in enumerate(names)
    }
    raw = {
        "case": case,
        "rate_bps": rate_bps,
        "latency_ms": delay,
        "folder": str(folder),
        "names": names,
        "exit_codes": codes,
        "process_seconds": seconds,
        "wire": wire,
        "cpu_s": cpu,
        "cores": os.cpu_count(),
    }
    (folder / "raw.json").write_text(json.dumps(raw, indent=1))
    return raw


def _sample_cpu(watched: list, cpu: dict[str, float]) -> None:
    """The CPU seconds each watched process has used, as last seen (a node's last 0.2 s
    before it exits are not seen)."""
    for name, helper in watched:
        seconds = cpu_seconds(helper.proc.pid)
        if seconds is not None:
            cpu[name] = seconds


def _wait_nodes(
    lab: LinkLab, nodes: list, timeout: float, sample: Callable[[], None]
) -> list[int | None]:
    """Wait for every node (``sample()`` every 0.2 s); after one fails (or ``timeout``), the
    others get 60 s, then stop."""
    deadline = time.monotonic() + timeout
    while any(n.proc.poll() is None for n in nodes) and time.monotonic() < deadline:
        if any((n.proc.poll() or 0) != 0 for n in nodes):
            deadline = min(deadline, time.monotonic() + 60)
        sample()
        time.sleep(0.2)
    return [lab.stop(n) if n.proc.poll() is None else n.proc.returncode for n in nodes]


def analyse(raw: dict, args: argparse.Namespace) -> dict:
    """Per-node figures, traffic, round anatomy and the case's loss (see link_report)."""
    folder, names = Path(raw["folder"]), raw["names"]
    events = {name: R.read_events(folder / f"{name}.out") for name in names}
    figures = {name: R.node_figures(events[name], args.inner_steps) for name in names}
    closes = [e for e in events["master"] if e.name == "outer_step"]
    rounds = len(closes)
    result = dict(raw, rounds=rounds, nodes=figures)
    good = [f for f in figures.values() if "error" not in f]
    if any(raw["exit_codes"]) or len(good) < len(names):
        result["error"] = f"exit codes {raw['exit_codes']}; logs in {folder}"
        return result
    start = min(f["start_ts"] for f in good)
    result["wall_s"] = max(f["end_ts"] for f in good) - start
    evals = sorted(
        (int(e.fields["outer_step"]), e.ts, float(e.fields["loss"]))
        for e in events["master"]
        if e.name == "eval" and e.fields.get("scope") == "global"
    )
    result["evals"] = [(step, round(ts - start, 2), loss) for step, ts, loss in evals]
    result["loss"] = evals[-1][2] if evals else None  # the last round's global = the final one
    if args.final_eval_tokens > 0:
        result["loss"] = score_final(folder / "master" / "final", args.final_eval_tokens)
    if raw.get("cpu_s"):
        result["cpu"] = R.cpu_shares(raw["cpu_s"], names, raw["cores"], raw["process_seconds"])
    r = max(rounds, 1)
    for name in names:
        up, down = raw["wire"][name]
        figures[name].update(
            wire_up_per_round=up / r,
            wire_down_per_round=down / r,
            event_up_per_round=figures[name]["event_bytes_up"] / r,
            event_down_per_round=figures[name]["event_bytes_down"] / r,
        )
    requests = R.read_requests(folder / "requests.jsonl")
    result["traffic"] = R.traffic(requests, names, rounds)
    rows = R.anatomy(events, "master", requests, names)
    result["anatomy"] = {"rounds": rows, "median": R.median_anatomy(rows)}
    result["busiest_bytes_per_round"] = max(max(v) for v in raw["wire"].values()) / r
    result["compute_per_round_s"] = args.inner_steps * statistics.median(f["step_s"] for f in good)
    if raw["rate_bps"]:
        series = R.counter_series(folder / "counters.jsonl")
        result["link_busy_s"] = {
            names[int(i[1:])]: [
                round(R.busy_seconds(p, 1, raw["rate_bps"]), 1),
                round(R.busy_seconds(p, 2, raw["rate_bps"]), 1),
            ]
            for i, p in series.items()
        }
        result["traffic_vs_compute"] = (
            result["busiest_bytes_per_round"] * 8 / raw["rate_bps"] / result["compute_per_round_s"]
        )
    return result


def score_final(final: Path, tokens: int) -> float | None:
    """The held-out loss of the master's ``final/`` over ``tokens`` held-out tokens
    (``speedtronic eval``, after the run: off the rounds' critical path)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "eval",
            "--config",
            str(final / "config.yaml"),
            "--checkpoint",
            str(final),
            "--format",
            "json",
            "--device",
            "cpu",
            "--set",
            f"eval.tokens={tokens}",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=final,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return float(json.loads(lines[-1])["loss"]) if done.returncode == 0 and lines else None


def calibrate(unshaped: dict, fractions: list[float]) -> tuple[list[float], str]:
    """Link rates (bit/s) at which the busiest link direction's bytes of a round take each
    fraction of a round's compute, in the unshaped run ``unshaped``; and how they were found."""
    busiest, compute = unshaped["busiest_bytes_per_round"], unshaped["compute_per_round_s"]
    rates = [busiest * 8 / (f * compute) for f in fractions]
    how = (
        f"the unshaped {unshaped['case']['dtype']} run's busiest link direction carries "
        f"{busiest / 1e6:.2f} MB a round, a round computes {compute:.2f} s: "
        + ", ".join(
            f"{f:.0%} -> {r / 1e6:.1f} Mbit/s" for f, r in zip(fractions, rates, strict=True)
        )
    )
    return rates, how


def main(argv: list[str] | None = None) -> int:
    """Run the unshaped and the shaped cases, print the tables, write the JSON."""
    args = parse_args(argv)
    if args.from_work is not None:
        return report(args, reanalyse(args))
    problem = support_problem()
    if problem is not None:
        print(f"skip: bench/diloco_link.py needs root, `ip netns` and `tc`: {problem}")
        return 0
    cases = shaped_cases(args.cases)
    fractions = [float(x) for x in args.fractions.split(",")]
    # KeyboardInterrupt: every finally runs; SIGINT too, which a shell's background job (`&`)
    # starts with ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    work = args.work or Path(tempfile.mkdtemp(prefix="diloco-link-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "work": str(work),
        "link": "per-node veth pairs (tbf up on the node's end, down on the Hub's)",
    }
    try:
        with LinkLab(args.nodes) as lab:
            for name in lab.stale():
                print(f"note: namespace {name} is left from a killed run (ip netns del {name})")
            print(f"logs: {work}", flush=True)
            if all(c["link"] == UNSHAPED for c in cases):  # measure the unshaped runs only
                unshaped = {_key(c): _run_and_say(lab, args, c, None, work) for c in cases}
                results.update(unshaped=unshaped, shaped=[], calibration="unshaped runs only")
                return report(args, results)
            unshaped = {}
            for dtype in sorted(
                {c["dtype"] for c in cases} | {args.calibrate_dtype}, key=DTYPES.index
            ):
                case = {
                    "name": f"unshaped-{dtype}-blocking",
                    "link": "unshaped",
                    "dtype": dtype,
                    "sync": "blocking",
                }
                unshaped[dtype] = _run_and_say(lab, args, case, None, work)
            if args.rates:
                rates = [float(x) * 1e6 for x in args.rates.split(",")]
                how = "given (--rates)"
            else:
                rates, how = calibrate(unshaped[args.calibrate_dtype], fractions)
            print(f"link rates: {how}", flush=True)
            results.update(
                unshaped=unshaped, rates_bps=dict(zip(LINKS, rates, strict=True)), calibration=how
            )
            shaped = [
                _run_and_say(lab, args, c, rates[LINKS.index(c["link"])], work) for c in cases
            ]
            results["shaped"] = shaped
    except KeyboardInterrupt:
        print("interrupted: every process stopped, the namespaces removed", flush=True)
        return 130
    return report(args, results)


def _key(case: dict) -> str:
    """An unshaped run's key in the results: its dtype (blocking, as the calibration runs),
    else its name."""
    return case["dtype"] if case["sync"] == "blocking" else case["name"]


def report(args: argparse.Namespace, results: dict) -> int:
    """Summarize, print the tables, write the JSON; 1 when a case failed."""
    summary = T.summarize(results, args)
    results["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(T.render(results, summary))
    print(f"wrote {args.out}")
    cases = [*results["shaped"], *results.get("unshaped", {}).values()]
    return 0 if all("error" not in c for c in cases) else 1


def reanalyse(args: argparse.Namespace) -> dict:
    """The results of the runs kept in ``--from-work`` (their ``raw.json``), analysed again."""
    raws = [json.loads(p.read_text()) for p in sorted(args.from_work.glob("*/raw.json"))]
    order = [(c["link"], c["dtype"], c["sync"]) for c in shaped_cases(args.cases)]

    def place(case: dict) -> tuple[int, str]:
        spec = (case["link"], case["dtype"], case["sync"])
        return (order.index(spec) if spec in order else len(order), case["name"])

    unshaped = {
        r["case"]["dtype"]: analyse(r, args) for r in raws if r["case"]["link"] == "unshaped"
    }
    shaped = sorted(
        (r for r in raws if r["case"]["link"] != "unshaped"),
        key=lambda r: place(r["case"]),
    )
    rates = {r["case"]["link"]: r["rate_bps"] for r in shaped}
    how = ", ".join(f"{k} {v / 1e6:.1f} Mbit/s" for k, v in rates.items())
    if args.calibrate_dtype in unshaped and not args.rates:
        how = calibrate(
            unshaped[args.calibrate_dtype], [float(x) for x in args.fractions.split(",")]
        )[1]
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "work": str(args.from_work),
        "link": "per-node veth pairs (tbf up on the node's end, down on the Hub's)",
        "unshaped": unshaped,
        "rates_bps": rates,
        "calibration": how,
        "shaped": [analyse(r, args) for r in shaped],
    }


def _run_and_say(
    lab: LinkLab, args: argparse.Namespace, case: dict, rate: float | None, work: Path
) -> dict:
    label = "unshaped" if rate is None else f"{rate / 1e6:.1f} Mbit/s"
    print(f"{case['name']}: {label} ...", flush=True)
    result = analyse(run_case(lab, args, case, rate, work), args)
    if "error" in result:
        print(f"  failed: {result['error']}", flush=True)
    else:
        mean_util = statistics.fmean(n["utilization"] for n in result["nodes"].values())
        print(
            f"  wall {result['wall_s']:.1f} s, {result['rounds']} rounds, node utilization "
            f"{mean_util:.2f}, loss {result['loss']}",
            flush=True,
        )
    return result


if __name__ == "__main__":
    raise SystemExit(main())
