"""Chaos: a master and three workers (real ``speedtronic run`` processes) over the Hub emulator
while the exchange misbehaves on a schedule, nodes are SIGKILLed and resumed, and a hostile
writer plants bad files (issue 12, deliverable 2).

Schedule (seconds after the first round): background noise (5xx, dropped connections) all
along; a 5xx burst; 429s with Retry-After; truncated downloads; slow responses while a worker
and then the master are SIGKILLed and restarted (likely mid-upload / mid-publish); a 30 s
outage (every request fails); a worker's contribution damaged in storage as it lands (its
LFS object cut by 1,000 bytes behind its pointer, or, kept in git, a value changed in place:
issue 31); planted garbage, oversized and NaN deltas; a planted NaN global.

Asserts invariants, never timings: every node finishes with exit code 0; no contribution is
aggregated twice; every upload is aggregated or counted as dropped, but for the damaged one,
which is refused (and only it) and its node hears of it; the global published at
the end loads and is finite; the planted files are refused and counted; nodes refused the NaN
global; retries happened and ``/metrics`` shows the same counters as the event log. Prints a
table of what was injected and what happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hub_emulator_fixtures import TEST_TOKEN, fast_retry
from process_support import free_port, jsonl_events, reap, wait_for

from speedtronic.diloco.codec import first_non_finite, state_to_bytes
from speedtronic.diloco.exchange import parse_delta_path
from speedtronic.diloco.hub import HubClient
from speedtronic.testing.hub_server import FaultConfig, HubEmulator, LfsConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REPO = "org/chaos"
_RUNNING: list[subprocess.Popen] = []


class Node:
    """One ``speedtronic run`` process (restartable) with its metrics port."""

    def __init__(self, tmp: Path, name: str, role: str, env: dict):
        self.tmp, self.name, self.role, self.env = tmp, name, role, env
        self.dir = tmp / name
        self.jsonl = self.dir / "events.jsonl"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.scrapes: list[dict[str, float]] = []
        self.starts = 0

    def start(self) -> Node:
        env = dict(
            self.env,
            SPEEDTRONIC_DISTRIBUTED__ROLE=self.role,
            SPEEDTRONIC_NODE_ID=self.name,
            SPEEDTRONIC_RUN__OUTPUT_DIR=str(self.dir),
            SPEEDTRONIC_LOGGING__JSON_FILE=str(self.jsonl),
            SPEEDTRONIC_METRICS__PORT=str(self.port),
        )
        self.starts += 1
        with open(self.tmp / f"{self.name}.out", "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "speedtronic", "run", "--config", "configs/diloco.yaml"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _RUNNING.append(self.proc)
        return self

    def events(self, name: str) -> list[dict]:
        return jsonl_events(self.jsonl, name)

    def scrape(self) -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return
        sample = {"start": float(self.starts)}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("speedtronic_diloco_") and s.name.endswith("_total"):
                    sample[s.name] = sample.get(s.name, 0.0) + s.value
        self.scrapes.append(sample)

    def rounds_scraped(self) -> float:
        """The most rounds this incarnation's ``/metrics`` has shown (0 before any)."""
        mine = [s for s in self.scrapes if s["start"] == self.starts]
        return max((s.get("speedtronic_diloco_rounds_total", 0.0) for s in mine), default=0.0)

    def kill_and_restart(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        self.start()

    def tail(self) -> str:
        path = self.tmp / f"{self.name}.out"
        return path.read_text()[-3000:] if path.exists() else ""


@pytest.fixture(autouse=True)
def _reap():
    yield
    reap(_RUNNING)


def _env(emulator: HubEmulator) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_TOKEN=TEST_TOKEN,
        HF_ENDPOINT=emulator.url,
        HF_HUB_DISABLE_TELEMETRY="1",
        SPEEDTRONIC_DISTRIBUTED__REPO_ID=REPO,
        # long enough to outlast the schedule: a run that ended during the outage left no
        # rounds for the restarted master and no live master for the planted files
        SPEEDTRONIC_RUN__MAX_STEPS="160",
        SPEEDTRONIC_DISTRIBUTED__INNER_STEPS="5",
        SPEEDTRONIC_DISTRIBUTED__POLL_INTERVAL="0.2",
        SPEEDTRONIC_DISTRIBUTED__ROUND_TIMEOUT="4",
        SPEEDTRONIC_DISTRIBUTED__RETRY_INITIAL="0.05",
        SPEEDTRONIC_DISTRIBUTED__RETRY_MAX="0.5",
        SPEEDTRONIC_DISTRIBUTED__RETRY_ATTEMPTS="6",
        SPEEDTRONIC_DISTRIBUTED__REQUEST_TIMEOUT="3",
        SPEEDTRONIC_CHECKPOINT__EVERY_STEPS="5",
        SPEEDTRONIC_CHECKPOINT__RESUME="true",
        SPEEDTRONIC_EVAL__TOKENS="512",
        SPEEDTRONIC_EVAL__EVERY_STEPS="0",
        SPEEDTRONIC_LOGGING__EVERY_STEPS="20",
    )
    return env


def _wait_all(nodes: list[Node], seconds: float) -> None:
    """Every node exits 0 within one shared deadline, inside the test's own timeout, so a
    node that hangs fails here with the output of every node still running."""
    deadline = time.monotonic() + seconds
    for node in nodes:
        try:
            code = node.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running = [n for n in nodes if n.proc.poll() is None]
            tails = "\n".join(f"--- {n.name} ---\n{n.tail()}" for n in running)
            pytest.fail(
                f"still running after {seconds:.0f} s: {[n.name for n in running]}\n{tails}"
            )
        assert code == 0, node.tail()


def _plant(writer: HubClient, master: Node) -> dict[str, int]:
    """Bad files from a writer to the exchange: garbage, oversized and NaN deltas for the
    open round under a node id without a status record (never waited for), then a NaN global."""
    meta = writer.global_metadata()
    shapes = {k: v for k, v in writer.read_global(meta).items() if v.is_floating_point()}
    r = meta.outer_step
    nan = {k: torch.full_like(v, float("nan")) for k, v in shapes.items()}
    writer.commit(
        {
            f"nodes/evil/delta_{r}.safetensors": b"\x10\x00\x00\x00garbage-not-safetensors",
            f"nodes/evil2/delta_{r}.safetensors": b"\x00" * (8 << 20),
            f"nodes/evil3/delta_{r}.safetensors": state_to_bytes(nan),
        },
        message="plant bad deltas",
    )
    glob = writer.read_global(meta)
    poisoned = {
        k: (torch.full_like(v, float("nan")) if v.is_floating_point() else v)
        for k, v in glob.items()
    }
    writer.publish_global(
        poisoned, outer_step=r + 50, ledger=writer.read_ledger(), run_id=meta.run_id
    )
    return {"deltas": 3, "globals": 1}


#: How the Hub stores the exchange's files: "regular" (every file in git: a repository whose
#: .gitattributes tracks nothing, and no file reaches the Hub's 10 MiB LFS threshold at this
#: model size) or "lfs" (as a new Hub repository: its .gitattributes tracks *.safetensors, so
#: every delta and global goes through the LFS batch endpoint, storage PUTs and redirected
#: downloads, with the same fault schedule on the storage requests; issue 22).
PATHS = {"regular": LfsConfig(gitattributes=""), "lfs": LfsConfig(threshold=1024)}


@pytest.mark.timeout(600)  # the phases' own waits are bounded; a normal run takes about 60 s
@pytest.mark.parametrize("path", sorted(PATHS))
def test_chaos_every_node_finishes_nothing_counted_twice_nothing_lost(tmp_path, path):
    emulator = HubEmulator(
        0, token=TEST_TOKEN, faults=FaultConfig(seed=1234), lfs=PATHS[path]
    ).start()
    try:
        started = time.monotonic()
        _chaos(tmp_path, emulator)
        print(f"chaos over the {path} path: {time.monotonic() - started:.0f} s")
        _check_path(emulator, path)
    finally:
        emulator.stop()


def _check_path(emulator: HubEmulator, path: str) -> None:
    """The files took the path under test, and on the LFS path storage took faults too."""
    stats = emulator.stats()
    counts, faults = stats["counts"], stats["faults_by_endpoint"]
    storage = {k: v for k, v in faults.items() if "storage" in k or "lfs" in k}
    print(f"faults on the large-file path: {storage}")
    if path == "regular":
        assert not [k for k in counts if "storage" in k or "lfs" in k], counts
        return
    assert stats["lfs_files"][REPO], "nothing in the repository is an LFS file"
    for kind in ("POST lfs-batch", "PUT storage-upload", "GET storage-download"):
        assert counts.get(kind, 0) > 0, (kind, counts)
    for fault in ("error", "drop"):
        assert any(k.startswith(f"{fault} storage") for k in storage), (fault, storage)
    assert not [k for k in counts if k.endswith(" xet")], counts


def _damage_next_contribution(emulator: HubEmulator) -> list[tuple[str, int]]:
    """Arm the emulator to damage the next contribution of w2 or w3 as its commit lands
    (under the emulator's lock, so no reader sees it whole): its LFS object loses its last
    1,000 bytes (the pointer keeps the size), or a file kept in git has a value changed in
    place (same size). Returns the list the damaged ``(node, round)`` is appended to."""
    damaged: list[tuple[str, int]] = []

    def damage(repo_id: str, files: dict) -> None:
        for path in files:
            parsed = parse_delta_path(path)
            if damaged or parsed is None or parsed[0] not in ("w2", "w3"):
                continue
            repo = emulator.repos[repo_id]
            oid = repo.lfs.get(path)
            if oid is not None:
                emulator.lfs.objects[oid] = emulator.lfs.objects[oid][:-1000]
            else:
                data = bytearray(repo.files[path])
                data[-4] ^= 0x01  # the lowest mantissa bit of the last value
                repo.files[path] = bytes(data)
            damaged.append(parsed)

    emulator.on_commit = damage
    return damaged


def _chaos(tmp: Path, emulator: HubEmulator) -> None:
    env = _env(emulator)
    master = Node(tmp, "m", "master", env).start()
    workers = [Node(tmp, f"w{i}", "worker", env).start() for i in (1, 2, 3)]
    nodes = [master, *workers]
    stop_scraping = threading.Event()

    def scraper() -> None:
        while not stop_scraping.is_set():
            for node in nodes:
                node.scrape()
            time.sleep(0.5)

    threading.Thread(target=scraper, daemon=True).start()
    injected: list[str] = []

    def phase(name: str, seconds: float, **faults) -> None:
        injected.append(name)
        emulator.set_faults(**faults)
        time.sleep(seconds)
        emulator.set_faults(
            error_rate=0.05, drop_rate=0.03, rate_limit_rate=0.0, slow_rate=0.0, truncate_rate=0.0
        )

    wait_for(lambda: len(master.events("outer_step")) >= 2, 240, "two rounds")
    emulator.set_faults(error_rate=0.05, drop_rate=0.03)  # background noise from here on
    phase("5xx burst", 3, error_rate=0.6)
    phase("429 + Retry-After", 3, rate_limit_rate=0.4, retry_after=0.3)
    phase("truncated downloads", 3, truncate_rate=0.4)
    injected.append("slow responses + SIGKILL/restart of w1")
    emulator.set_faults(slow_rate=0.8, slow_seconds=1.0)
    time.sleep(1.5)
    workers[0].kill_and_restart()
    injected.append("SIGKILL/restart of the master")
    time.sleep(1.0)
    master.kill_and_restart()
    emulator.set_faults(slow_rate=0.0)
    wait_for(
        lambda: master.events("diloco_started") and len(master.events("diloco_started")) >= 2,
        180,
        "the master back",
    )
    phase("30 s outage", 30, error_rate=1.0)
    # a round of the restarted master, seen on its /metrics (events of the first incarnation
    # would satisfy a wait on the event log at once; a short-lived last round may never be
    # scraped before the process exits)
    wait_for(
        lambda: master.rounds_scraped() >= 1, 120, "a round on the restarted master's /metrics"
    )
    # no faults while the victim's commit lands: a retried commit would send it whole again
    emulator.set_faults(error_rate=0.0, drop_rate=0.0)
    damaged = _damage_next_contribution(emulator)
    wait_for(lambda: damaged, 120, "a worker's contribution to damage")
    name = f"{damaged[0][0]}/{damaged[0][1]}"
    injected.append(f"contribution {name} damaged in storage")
    refusals = lambda: [r for r in master.events("outer_step") if name in r["refused"]]  # noqa: E731
    wait_for(refusals, 120, f"the master's round that refuses {name}")
    writer = HubClient(REPO, token=TEST_TOKEN, endpoint=emulator.url, retry=fast_retry(attempts=8))
    # The master is paused (SIGSTOP) while the NaN global is live: a running master overwrites
    # it at its next publish, which may come before any worker's next poll.
    master.proc.send_signal(signal.SIGSTOP)
    try:
        planted = _plant(writer, master)
        wait_for(
            lambda: any(w.events("global_rejected") for w in workers), 30, "a refused NaN global"
        )
    finally:
        master.proc.send_signal(signal.SIGCONT)
    injected.append("planted garbage / oversized / NaN deltas and a NaN global (master paused)")
    emulator.set_faults(error_rate=0.05, drop_rate=0.03)
    _wait_all(nodes, seconds=180)
    stop_scraping.set()
    emulator.set_faults(error_rate=0.0, drop_rate=0.0)

    # ---------------------------------------------------------------- invariants
    rounds = master.events("outer_step")
    tallies = rounds + master.events("final_global")  # refusals after the last round too
    included = [tuple(i.split("/")) for r in rounds for i in r["included"]]
    included = [(n, int(label)) for n, label in included]
    assert len(included) == len(set(included)), "a contribution was aggregated twice"
    dropped = {(i.split("/")[0], int(i.split("/")[1])) for r in tallies for i in r["dropped"]}
    refused = {(i.split("/")[0], int(i.split("/")[1])) for r in tallies for i in r["refused"]}
    uploaded = {(n.name, e["round"]) for n in nodes for e in n.events("delta_uploaded")}
    assert refused & uploaded == set(damaged), (sorted(refused), damaged)
    lost = uploaded - set(included) - dropped - refused
    assert not lost, f"uploads neither aggregated nor counted: {sorted(lost)}"
    victim, round = damaged[0]
    heard = [e["round"] for n in nodes if n.name == victim for e in n.events("delta_refused")]
    assert heard == [round], (victim, heard)
    meta, final = writer.fetch_global()
    assert meta.final and first_non_finite(final) is None
    corrupt = sum(r["deltas_corrupt"] for r in tallies)
    assert corrupt >= planted["deltas"] + 1, corrupt
    assert not [p for p in writer.list_files() if p.startswith("nodes/evil")]
    rejected = sum(len(w.events("global_rejected")) for w in workers)
    assert rejected >= 1, "no worker refused the NaN global"
    retries = {n.name: len(n.events("transport_retry")) for n in nodes}
    assert sum(retries.values()) > 0
    counts = emulator.stats()["counts"]
    faults = {k: v for k, v in counts.items() if k.startswith("fault:")}
    for kind in ("fault:error", "fault:drop", "fault:rate_limit", "fault:truncate", "fault:slow"):
        assert faults.get(kind, 0) > 0, (kind, faults)
    # /metrics: counters of each incarnation never exceed the events logged so far, and the
    # last scrape of each process shows what it went through
    for node in nodes:
        assert node.scrapes, f"{node.name} never answered /metrics"
        last = node.scrapes[-1]
        assert last.get("speedtronic_diloco_retries_total", 0) <= retries[node.name]
    assert master.rounds_scraped() >= 1

    print(f"\n{'fault injected':<58}{'survived':>10}")
    for name in injected:
        print(f"{name:<58}{'yes':>10}")
    print(f"emulator faults served: {faults}")
    head = ("uploaded", "included", "retries", "restarts", "global refused")
    print(f"{'node':<6}" + "".join(f"{h:>16}" for h in head))
    for node in nodes:
        mine = [x for x in included if x[0] == node.name]
        cells = (
            len([u for u in uploaded if u[0] == node.name]),
            len(mine),
            retries[node.name],
            node.starts - 1,
            len(node.events("global_rejected")),
        )
        print(f"{node.name:<6}" + "".join(f"{c:>16}" for c in cells))
    reasons: dict[str, int] = {}
    for r in rounds:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    print(
        f"rounds {len(rounds)} {reasons}; deltas dropped late {len(dropped)}, corrupt/refused "
        f"{corrupt}, replays skipped {sum(r['deltas_skipped'] for r in tallies)}"
    )
