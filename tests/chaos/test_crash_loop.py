"""Crash loop (issue 12, deliverable 3): SIGKILLs at random points of checkpoint saving, the
DiLoCo master's round (publish + local outer-state persistence) and directory publishing;
after each kill the next start loads the newest complete state. In the master's rounds a
second node's contribution is damaged in the exchange every round (issue 31): it is refused
every time and the round closes without it.

``tests/chaos/crash_loop.py`` does the killing (one process, forked writers, real SIGKILL)
and prints its counts; this test runs it and prints them as a table. Two deterministic
reproductions below pin the master gaps the loop counts but does not assert (master.py
belongs to the DiLoCo round; they are expected failures until it is fixed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
KILLS_PER_TARGET = 20  # 60 SIGKILLs in all, ~10-30 s on two cores


def _table(result: dict) -> str:
    exchange = result.get("exchange", "directory")
    lines = [f"crash loop (seed {result['seed']}, {exchange}, {result['seconds']} s):"]
    for target in ("checkpoint", "master", "publish"):
        counts = result.get(target)
        if counts:
            shown = ", ".join(f"{key} {value}" for key, value in counts.items())
            lines.append(f"  {target:<10} {shown}")
    return "\n".join(lines)


def _loop(tmp_path: Path, *options: str) -> dict:
    seed = os.environ.get("SPEEDTRONIC_CRASH_SEED")
    command = [
        sys.executable,
        str(ROOT / "tests" / "chaos" / "crash_loop.py"),
        "--workdir",
        str(tmp_path),
        *options,
        *(["--seed", seed] if seed else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("\n" + _table(result))
    assert done.returncode == 0 and "failure" not in result, result.get("failure", done.stderr)
    return result


def test_crash_loop_next_start_loads_the_newest_complete_state(tmp_path) -> None:
    result = _loop(tmp_path, "--kills", str(KILLS_PER_TARGET))
    kills = sum(result[target]["kills"] for target in ("checkpoint", "master", "publish"))
    assert kills >= 50
    for target in ("checkpoint", "master", "publish"):
        counts = result[target]
        assert counts["recovered"] + counts["empty"] == counts["kills"]
    assert result["checkpoint"]["mid_write"] > 0  # kills did land inside writes
    # the killed writer's folder lock is left behind and every restart took it over (issue 39)
    assert result["checkpoint"]["stale_locks"] > 0
    # a second node's contribution, changed in place after its digest was taken, is refused
    # and pruned in every round that closed after a restart (issue 31)
    assert result["master"]["refused"] == result["master"]["recovered"]
    assert result["publish"]["torn_publish"] + result["publish"]["mid_write"] > 0


def test_crash_loop_over_the_hub_large_file_path(tmp_path) -> None:
    """The master and publish targets over a Hub repository on the emulator, every delta and
    global through the LFS path (issue 22): same checks, commits are atomic."""
    kills = KILLS_PER_TARGET // 2
    options = ("--kills", str(kills), "--exchange", "hub-lfs", "--targets", "master,publish")
    result = _loop(tmp_path, *options)
    print(f"  hub requests {result['hub_requests']}")
    for target in ("master", "publish"):
        counts = result[target]
        assert counts["kills"] == kills
        assert counts["recovered"] + counts["empty"] == counts["kills"]
        assert counts["torn_publish"] == 0 and counts.get("stuck", 0) == 0
    assert result["master"]["recovered"] > 0 and result["publish"]["recovered"] > 0
    # a second node's large-file object, cut short behind its pointer as it lands, is
    # refused and pruned in every round that closed after a restart (issue 31)
    assert result["master"]["refused"] == result["master"]["recovered"]
    requests = result["hub_requests"]
    for kind in ("POST lfs-batch", "PUT storage-upload", "GET storage-download"):
        assert requests.get(kind, 0) > 0, requests


# ----------------------------------------------------------------------------- master gaps


def _round(transport, master) -> bool:
    import crash_loop

    crash_loop._contribute(transport, master)
    return master.poll_once()


def test_master_restart_after_a_torn_publish_closes_the_next_round(tmp_path) -> None:
    import crash_loop

    master, transport = crash_loop._master(tmp_path)
    master.reconcile()
    assert _round(transport, master) and master.outer_step == 1

    def torn(additions, deletions, message):  # killed after weights and ledger, before record
        for remote, data in list(additions.items())[:2]:
            transport._write(remote, data)
        raise KeyboardInterrupt

    crash_loop._contribute(transport, master)  # round 1's contribution is in
    transport._commit = torn
    with pytest.raises(KeyboardInterrupt):
        master.poll_once()  # closes round 1: weights (outer step 2) and ledger land, no record
    restarted, transport = crash_loop._master(tmp_path)
    restarted.reconcile()
    newest, _ = transport.fetch_global()
    assert restarted.outer_step == newest.outer_step == 2
    assert _round(transport, restarted)


def test_master_killed_while_persisting_its_state_keeps_the_last_complete_state(
    tmp_path, monkeypatch
) -> None:
    """The local state is one atomic file (it was two: a kill between them lost it all)."""
    import crash_loop

    from speedtronic.diloco import ledger as store_module

    master, transport = crash_loop._master(tmp_path)
    master.reconcile()
    assert _round(transport, master) and _round(transport, master)
    momentum = {k: v.clone() for k, v in master.state.optimizer.momentum_buffers().items()}

    def killed(write, path):  # dies before the rename: the previous file stays
        raise KeyboardInterrupt

    monkeypatch.setattr(store_module, "atomic_write_with", killed)
    with pytest.raises(KeyboardInterrupt):
        _round(transport, master)
    monkeypatch.undo()
    restarted, _ = crash_loop._master(tmp_path)
    assert restarted.agreement.has_local_state and restarted.outer_step in (2, 3)
    if restarted.outer_step == 2:
        loaded = restarted.state.optimizer.momentum_buffers()
        assert all(torch.equal(loaded[k], v) for k, v in momentum.items())
