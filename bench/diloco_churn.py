"""DiLoCo while nodes come and go as pods do (issue 40, item 4).

K ``speedtronic train`` processes (a master that trains + K-1 workers) meet through a shared
directory (``file://``). On a schedule of published outer steps the bench

    kill:NODE@R      SIGKILLs NODE once global R is published (a lost pod: no goodbye)
    term:NODE@R      SIGTERMs NODE (a scale-down or an eviction: the node leaves)
    join:NODE@R      starts a new node NODE (a scale-up)
    restart:NODE@R   starts NODE again with ``--resume`` (its checkpoint, the same node id)

A node started by the schedule trains until the first of the workers that were never
churned is done, then gets a SIGTERM (it leaves, so the run ends with the others). Then the
same K nodes run without churn twice: with as many node-steps in all as the churn run's aggregated
contributions held (the issue's comparison), and for as many rounds as the churn run closed
(more node-steps: at this length the loss follows the rounds more than the node-steps).
Reported, per event: the seconds every other node lost (its
waits for the globals of the two rounds after the event, beyond the run's median wait, as
its ``sync_wait`` events measure them), the rounds among them that closed on
``round_timeout`` (short), and for a join or a restart the seconds from the process start to
the global that first holds its contribution. For the run: the final global's held-out loss
against the steady run's, and the ledger check (every contribution a node uploaded is in
exactly one round's ``included`` or counted ``stale``; none twice).

    python bench/diloco_churn.py                             # the issue's schedule, 6 nodes
    python bench/diloco_churn.py --set distributed.round_timeout=60
    python bench/diloco_churn.py --from-work /tmp/churn      # analyse kept runs again
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
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from link_report import Event, read_events  # noqa: E402

SCHEDULE = "kill:w1@4,term:w2@7,join:w6@10,restart:w1@13"
KINDS = ("kill", "term", "join", "restart")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=6, help="K: a master that trains + K-1 workers")
    p.add_argument("--rounds", type=int, default=20, help="rounds of the first K nodes")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--schedule", default=SCHEDULE, help="KIND:NODE@ROUND,... (see above)")
    p.add_argument("--round-timeout", type=float, default=30.0)
    p.add_argument("--drop-after", type=int, default=2)
    p.add_argument("--poll-interval", type=float, default=0.25)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--skip-steady", action="store_true", help="the churn run only")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more override for every node (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--work", type=Path, default=None, help="logs (default: a temp folder)")
    p.add_argument("--from-work", type=Path, default=None, help="analyse kept runs, run nothing")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/diloco_churn.json")
    return p.parse_args(argv)


def parse_schedule(text: str) -> list[dict]:
    """``KIND:NODE@ROUND,...`` as event records, in the order of their rounds."""
    events = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            kind, rest = item.split(":")
            node, at = rest.split("@")
            events.append({"kind": kind, "node": node, "at": int(at)})
        except ValueError:
            raise SystemExit(f"--schedule: {item!r} is not KIND:NODE@ROUND") from None
        if kind not in KINDS:
            raise SystemExit(f"--schedule: {kind!r} is not one of {KINDS}")
    return sorted(events, key=lambda e: e["at"])


def node_sets(args: argparse.Namespace, role: str, node: str, folder: Path) -> list[str]:
    """The ``--set`` overrides of one node over configs/diloco.yaml."""
    return [
        "run.seed=1",
        "run.device=cpu",
        "data.synthetic=markov",
        "eval.holdout=0.05",
        f"eval.tokens={args.eval_tokens}",
        "eval.every_steps=0",  # the master scores every global
        f"checkpoint.every_steps={args.inner_steps}",
        "checkpoint.keep_last=2",
        "logging.every_steps=1000",
        "logging.format=json",
        f"distributed.role={role}",
        f"distributed.node_id={node}",
        f"distributed.repo_id=file://{folder / 'exchange'}",
        f"distributed.inner_steps={args.inner_steps}",
        f"distributed.expected_nodes={args.nodes}",
        f"distributed.poll_interval={args.poll_interval}",
        f"distributed.round_timeout={args.round_timeout}",
        f"distributed.drop_after={args.drop_after}",
        "distributed.retry_initial=0.2",
        "distributed.retry_max=2",
        *args.sets,
    ]


class Cluster:
    """The node processes of one run, their logs under ``folder`` and the exchange."""

    def __init__(self, args: argparse.Namespace, folder: Path):
        self.args, self.folder = args, folder
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, list[float]] = {}  # node -> wall times it was started
        folder.mkdir(parents=True, exist_ok=True)

    def start(self, node: str, max_steps: int, *, resume: bool = False) -> None:
        """Start ``node`` (the first is the master) training to ``max_steps``."""
        role = "master" if node == "master" else "worker"
        out = self.folder / node
        sets = [f"run.max_steps={max_steps}", *node_sets(self.args, role, node, self.folder)]
        argv = [sys.executable, "-m", "speedtronic", "train", "--config"]
        argv += [str(ROOT / "configs/diloco.yaml"), "--output-dir", str(out)]
        argv += [x for s in sets for x in ("--set", s)] + (["--resume"] if resume else [])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        log = open(self.folder / f"{node}.out", "a")  # noqa: SIM115 (closed with the process)
        self.procs[node] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started.setdefault(node, []).append(time.time())

    def published(self) -> int:
        """The outer step of the published global (-1: none yet)."""
        try:
            record = json.loads((self.folder / "exchange/global/step_count.json").read_text())
            return int(record["outer_step"])
        except (OSError, ValueError, KeyError):
            return -1

    def checkpoint_step(self, node: str) -> int:
        """The step of ``node``'s newest checkpoint (0: none)."""
        try:
            return int(
                json.loads((self.folder / node / "checkpoints/latest.json").read_text())["step"]
            )
        except (OSError, ValueError, KeyError):
            return 0

    def running(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run(args: argparse.Namespace, folder: Path, schedule: list[dict], steps: int) -> dict:
    """One run: K nodes to ``steps`` steps each, the ``schedule`` applied as globals are
    published; the raw material of :func:`analyse` (kept as ``raw.json``)."""
    cluster = Cluster(args, folder)
    names = ["master"] + [f"w{i}" for i in range(1, args.nodes)]
    for name in names:
        cluster.start(name, steps)
    pending, done, globals_at = list(schedule), [], {}
    steady = set(names) - {e["node"] for e in schedule}  # never churned: they end the run
    deadline = time.monotonic() + args.timeout
    while cluster.running() and time.monotonic() < deadline:
        outer = cluster.published()
        globals_at.setdefault(outer, time.time())
        while pending and pending[0]["at"] <= outer:
            done.append(apply(cluster, pending.pop(0), outer, args, steps))
        if not pending and steady - {"master"} - set(cluster.running()):
            for node in set(cluster.running()) - steady:  # joined or restarted: they leave
                cluster.procs[node].send_signal(signal.SIGTERM)
        time.sleep(0.05)
    timed_out = bool(cluster.running())
    cluster.stop_all()
    raw = {
        "folder": str(folder),
        "nodes": sorted(cluster.procs),
        "steps": steps,
        "events": done,
        "globals_at": {str(k): v for k, v in sorted(globals_at.items())},
        "started": cluster.started,
        "exit_codes": {n: p.returncode for n, p in cluster.procs.items()},
        "timed_out": timed_out,
    }
    (folder / "raw.json").write_text(json.dumps(raw, indent=1))
    return raw


def apply(cluster: Cluster, event: dict, outer: int, args: argparse.Namespace, steps: int) -> dict:
    """Carry out one scheduled event now (global ``outer`` is the newest published)."""
    node, kind = event["node"], event["kind"]
    if kind in ("kill", "term"):
        cluster.procs[node].send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
    elif kind == "join":
        cluster.start(node, 2 * steps)  # until the others end (then a SIGTERM)
    else:
        cluster.procs[node].wait()
        cluster.start(node, cluster.checkpoint_step(node) + 2 * steps, resume=True)
    return dict(event, outer=outer, time=time.time())


# -- analysis -------------------------------------------------------------------------
def _events(folder: Path, node: str) -> list[Event]:
    path = folder / f"{node}.out"
    return read_events(path) if path.exists() else []


def ledger_check(uploads: dict[str, set[int]], closes: list[Event]) -> dict:
    """Every uploaded ``node/round`` is included once or counted stale; none twice."""
    included: dict[str, int] = {}
    for close in closes:
        for name in close.fields.get("included", []):
            included[name] = included.get(name, 0) + 1
    stale = {name for c in closes for name in c.fields.get("dropped", [])}
    sent = {f"{node}/{r}" for node, rounds in uploads.items() for r in rounds}
    twice = sorted(n for n, count in included.items() if count > 1)
    lost = sorted(n for n in sent if n not in included and n not in stale)
    skipped = sum(int(c.fields.get("deltas_skipped", 0)) for c in closes)
    return {
        "uploaded": len(sent),
        "included": len(included),
        "stale": len(stale),
        "skipped_replays": skipped,
        "twice": twice,
        "lost": lost,
        "ok": not twice and not lost,
    }


def analyse(raw: dict, args: argparse.Namespace) -> dict:
    """Per-event costs, rounds, the ledger check and the final loss of one run."""
    folder = Path(raw["folder"])
    events = {node: _events(folder, node) for node in raw["nodes"]}
    closes = [e for e in events["master"] if e.name == "outer_step"]
    waits = {
        node: [
            (int(e.fields["outer_step"]), float(e.fields["seconds"]))
            for e in evs
            if e.name == "sync_wait"
        ]
        for node, evs in events.items()
    }
    every = [s for rows in waits.values() for _, s in rows]
    median = statistics.median(every) if every else 0.0
    uploads = {
        node: {int(e.fields["round"]) for e in evs if e.name == "delta_uploaded"}
        for node, evs in events.items()
    }
    evals = [e for e in events["master"] if e.name == "eval" and e.fields.get("scope") == "global"]
    result = {
        "rounds": len(closes),
        "short_rounds": sum(c.fields.get("reason") == "timeout" for c in closes),
        "median_wait_s": median,
        "median_round_s": statistics.median(float(c.fields["round_seconds"]) for c in closes)
        if closes
        else None,
        "loss": float(evals[-1].fields["loss"]) if evals else None,
        "node_steps": sum(len(c.fields.get("included", [])) for c in closes) * args.inner_steps,
        "ledger": ledger_check(uploads, closes),
        "exit_codes": raw["exit_codes"],
        "timed_out": raw["timed_out"],
        "per_event": [],
    }
    by_step = {int(c.fields["outer_step"]): c for c in closes}
    for event in raw["events"]:
        window = {event["outer"] + 1, event["outer"] + 2}
        lost = {
            node: round(sum(max(0.0, s - median) for step, s in rows if step in window), 2)
            for node, rows in waits.items()
            if node != event["node"] and any(step in window for step, _ in rows)
        }
        row = dict(event, lost_s=lost, lost_max_s=max(lost.values(), default=0.0))
        row["short_rounds"] = [
            s
            for s in sorted(window)
            if s in by_step and by_step[s].fields.get("reason") == "timeout"
        ]
        if event["kind"] in ("join", "restart"):
            row["first_included_s"] = first_included(raw, closes, event)
        result["per_event"].append(row)
    return result


def first_included(raw: dict, closes: list[Event], event: dict) -> float | None:
    """Seconds from the start of ``event``'s process to the publish of the first global
    that includes a contribution of its node made after that start."""
    node, started = event["node"], event["time"]
    for close in closes:
        rounds = [
            int(n.split("/")[1])
            for n in close.fields.get("included", [])
            if n.split("/")[0] == node
        ]
        if rounds and close.ts > started and max(rounds) >= event["outer"]:
            return round(close.ts - started, 2)
    return None


def report(churn: dict, steady: dict | None, rounds: dict | None) -> dict:
    """The figures of the runs and the issue's targets."""
    out = {"churn": churn, "steady": steady, "steady_rounds": rounds}
    for key, other in (("loss_ratio", steady), ("loss_ratio_rounds", rounds)):
        if other and churn["loss"] and other["loss"]:
            out[key] = churn["loss"] / other["loss"]
    print(
        f"churn run: {churn['rounds']} rounds, {churn['short_rounds']} closed on timeout, "
        f"median round {churn['median_round_s']} s, median wait {churn['median_wait_s']:.2f} s"
    )
    for row in churn["per_event"]:
        extra = (
            f", first included after {row.get('first_included_s')} s"
            if "first_included_s" in row
            else ""
        )
        print(
            f"  {row['kind']:8} {row['node']} at global {row['outer']}: others lost at most "
            f"{row['lost_max_s']:.2f} s (sum over the 2 rounds after), rounds closed short "
            f"{row['short_rounds']}{extra}"
        )
    ledger = churn["ledger"]
    print(
        f"  ledger: {ledger['uploaded']} uploaded, {ledger['included']} included, "
        f"{ledger['stale']} stale, {ledger['skipped_replays']} replays skipped, twice "
        f"{ledger['twice']}, lost {ledger['lost']}"
    )
    for name, other, key in (
        ("node-steps", steady, "loss_ratio"),
        ("rounds", rounds, "loss_ratio_rounds"),
    ):
        if other:
            print(
                f"steady run, same {name}: {other['rounds']} rounds, node-steps "
                f"{other['node_steps']} (churn {churn['node_steps']}), loss {other['loss']} vs "
                f"churn {churn['loss']} ({out.get(key, float('nan')):.4f}x)"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = args.rounds * args.inner_steps
    work = args.from_work or args.work or Path(tempfile.mkdtemp(prefix="diloco-churn-"))
    print(f"logs under {work}")
    kept = ("churn", "steady", "steady_rounds")
    raws = {
        n: json.loads((work / n / "raw.json").read_text())
        for n in kept
        if (work / n / "raw.json").exists()
    }
    if "churn" not in raws:
        raws["churn"] = run(args, work / "churn", parse_schedule(args.schedule), steps)
    churn = analyse(raws["churn"], args)
    runs: dict[str, dict | None] = {"steady": None, "steady_rounds": None}
    if not args.skip_steady:
        inner = args.inner_steps
        same_steps = max(round(churn["node_steps"] / args.nodes / inner), 1) * inner
        same_rounds = churn["rounds"] * inner
        for name, per_node in (("steady", same_steps), ("steady_rounds", same_rounds)):
            if name not in raws:
                raws[name] = run(args, work / name, [], per_node)
            runs[name] = analyse(raws[name], args)
    result = report(churn, runs["steady"], runs["steady_rounds"])
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
