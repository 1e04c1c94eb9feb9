"""bench/diloco_link.py, the DiLoCo bench over shaped links (issue 38, item 3).

- Without root, ``ip`` or ``tc`` it prints one ``skip:`` line and exits 0 (runs anywhere).
- Its latency relay delays each direction by the one-way time and does not limit throughput
  (no namespace needed: it runs on this host's loopback).
- Where root and tc are available: a tiny case end to end (2 nodes, a 1-layer model, 2 rounds,
  unshaped then one shaped case with added latency), and Ctrl-C in the middle of a run ends
  every process and removes every namespace. Each costs two short runs of two processes: the
  only way to know the bench still measures what it says.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from process_support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "diloco_link.py"
sys.path.insert(0, str(ROOT / "bench"))

from link_net import PREFIX, support_problem  # noqa: E402

TINY = [
    "--nodes",
    "2",
    "--steps",
    "4",
    "--inner-steps",
    "2",
    "--layers",
    "1",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--kv-heads",
    "2",
    "--vocab",
    "64",
    "--seq",
    "16",
    "--eval-tokens",
    "256",
    "--final-eval-tokens",
    "0",
    "--cases",
    "fast:fp32:blocking",
    "--calibrate-dtype",
    "fp32",
]
PROBLEM = support_problem()
needs_link = pytest.mark.skipif(PROBLEM is not None, reason=f"no shaped link here: {PROBLEM}")


def _namespaces(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{PREFIX}{pid}x")]


def _processes_under(folder: Path) -> list[int]:
    """Pids whose command line names ``folder`` (the bench's nodes and helpers)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(folder) in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_without_root_ip_or_tc_it_says_skip_in_one_line_and_exits_0(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no ip, no tc
    done = subprocess.run(
        [sys.executable, str(BENCH)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("skip: "), done.stdout
    assert ("not root" in lines[0]) or ("no `ip`" in lines[0]), lines[0]


def test_the_relay_delays_each_direction_without_limiting_throughput(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    target = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    port = free_port()
    relay = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "link_relay.py"),
            "relay",
            "--route",
            f"127.0.0.1:{port}=127.0.0.1:{target}",
            "--delay-ms",
            "100",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(relay.stdout.readline()) == {"ready": True}
        with socket.create_connection(("127.0.0.1", port)) as conn:
            started = time.monotonic()
            conn.sendall(b"x")
            assert conn.recv(1) == b"x"
            round_trip = time.monotonic() - started
            assert 0.2 <= round_trip < 0.6, round_trip  # 100 ms each way, twice
            payload, got = b"y" * (16 << 20), 0
            started = time.monotonic()
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            sender.start()
            while got < len(payload):
                got += len(conn.recv(1 << 20))
            sender.join()
            # 16 MiB echoed through two delayed directions: far faster than one chunk per
            # delay would allow (64 chunks x 0.2 s = 13 s)
            assert time.monotonic() - started < 5.0
    finally:
        relay.terminate()
        relay.wait(10)
        server.close()


@needs_link
def test_a_tiny_case_end_to_end_over_shaped_veth_links(tmp_path):
    out = tmp_path / "result.json"
    args = [*TINY, "--rates", "20,5", "--latency-ms", "20", "--work", str(tmp_path / "work")]
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    text, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, text
    assert not _namespaces(proc.pid)
    result = json.loads(out.read_text())
    cases = [result["unshaped"]["fp32"], *result["shaped"]]
    assert [c["case"]["name"] for c in cases] == ["unshaped-fp32-blocking", "fast-fp32-blocking"]
    for case in cases:
        assert case["rounds"] == 2 and not any(case["exit_codes"]), case.get("error")
        assert 0 < case["loss"] < 10
        for name, node in case["nodes"].items():
            assert node["uploads"] == 2, name
            assert 0 < node["compute_s"] <= node["wall_s"] and 0 < node["utilization"] <= 1
            # the wire carries the events' bytes and the protocol around them
            assert node["wire_up_per_round"] > node["event_up_per_round"] > 0, name
            assert case["traffic"][name]["http_up_bytes"] > 0
    shaped = result["shaped"][0]
    assert shaped["rate_bps"] == 20e6 and shaped["latency_ms"] == 20.0
    assert shaped["traffic_vs_compute"] > 0
    assert "sync blocking" in text and "what crosses the link" in text
    assert result["summary"]["rows"][1]["utilization"] > 0


@needs_link
def test_ctrl_c_in_the_middle_of_a_run_ends_every_process_and_removes_the_namespaces(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(BENCH),
            *TINY,
            "--rates",
            "20,5",
            "--work",
            str(work),
            "--out",
            str(tmp_path / "result.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (work / "unshaped-fp32-blocking" / "worker-1.out").exists(), 120, "nodes")
        assert _namespaces(proc.pid)
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, text
    assert "interrupted" in text
    assert not _namespaces(proc.pid)
    assert not _processes_under(work)


def test_a_case_names_its_overlap_steps_and_fragments_and_a_bad_one_is_refused():
    from diloco_link import node_sets, parse_args, shaped_cases

    case = shaped_cases("slow:int8:overlapped:10:4")[0]
    assert case["name"] == "slow-int8-overlapped-o10-f4"
    sets = node_sets(parse_args([]), case, "worker", "worker-1", Path("/tmp/x"))
    assert "distributed.overlap_steps=10" in sets and "distributed.fragments=4" in sets
    plain = shaped_cases("fast:fp32:overlapped")[0]
    assert plain["name"] == "fast-fp32-overlapped"
    assert not any(
        "overlap_steps" in s or "fragments" in s
        for s in node_sets(parse_args([]), plain, "worker", "worker-1", Path("/tmp/x"))
    )
    for bad in ("fast:int8:blocking:2", "fast:int8:overlapped:0", "fast:int8:overlapped:2:4:1"):
        with pytest.raises(SystemExit, match="OVERLAP_STEPS"):
            shaped_cases(bad)


def test_a_scheduled_merge_is_exchange_time_not_compute():
    from link_report import Event, node_figures

    # 10 steps of 0.1 s; inner_steps 10 with fragments: a boundary at step 5 (round_done) and
    # a merge at step 7 that waited 0.5 s (sync_wait inside the step)
    events, ts = [], 100.0
    for step in range(1, 11):
        took = 0.6 if step == 7 else 0.1
        ts += took
        if step == 7:
            events.append(Event(ts - 0.05, "sync_wait", {"seconds": 0.5}))
        if step == 5:
            events.append(Event(ts - 0.01, "round_done", {"wait_seconds": 0.0}))
        events.append(Event(ts, "train_step", {"step": step, "step_time_s": took}))
    events.append(Event(ts, "train_end", {"elapsed_s": ts - 100.0}))
    figures = node_figures(events, inner_steps=10)
    assert figures["compute_s"] == pytest.approx(1.0)
    assert figures["exchange_s"] == pytest.approx(0.5)
