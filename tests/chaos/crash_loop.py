"""Crash loop: SIGKILL a writer at random points, restart, check what the next start loads.

Run as a script (``tests/chaos/test_crash_loop.py`` does): one process imports torch once,
then for each target forks a child that writes state back to back and reports each write
that returned; the parent SIGKILLs it after a random delay (so the kill lands at a random
point of a write: inside ``torch.save``, between fsync and rename, between two files), then
plays the next start itself and checks that it loads the newest complete state. The next
child continues from what was loaded, so it is a crash *loop*.

Targets:

``checkpoint``  ``CheckpointManager.save`` (keep_last 2) of a ~1 MB state, the folder locked
                as ``train`` locks it (`speedtronic.folder_lock`). The next start must take
                the lock over (the killed writer's lock file is left behind, and not held:
                ``stale_locks`` counts them), and its ``load_latest`` must return a step >=
                the last save that returned (and at most one more), with tensors that match
                that step.
``master``      ``RoundMaster.poll_once`` over a shared-directory exchange, driven by a
                planted contribution per round (publish + ``_save_local_state``) and a
                second node's contribution that is damaged in the exchange every round (a
                value changed in place on a volume; its large-file object cut short behind
                its pointer on the Hub): refused every time, never aggregated, and the
                round closes without it (issue 31). The next
                start must load local outer state (one atomic file) at an outer step >= the
                last close that returned, agreeing with the published global (a local state
                that cannot be read is counted as ``torn_local`` and rebuilt from the
                published global). It then reconciles and must close one more round
                (``stuck`` must stay 0); a start one round behind weights whose ledger never
                landed is counted (``behind_published``): that round is recomputed.
``publish``     ``DirectoryTransport.publish_global`` of weights + ledger + record. The
                next ``fetch_global`` must return an outer step >= the last publish that
                returned (at most one more), with weights that match that step.

With ``--exchange hub-lfs`` the ``master`` and ``publish`` targets run over a Hub repository
on the emulator (started here, before any fork) whose files of 256 bytes or more (the
deltas and globals) take the large-file path (preupload ``lfs``, batch, storage PUT, pointer
commit; reads redirected to storage). A Hub commit is atomic, so ``torn_publish`` stays 0
there; ``orphans`` counts kills that landed between an object's upload to storage and the
commit that would point to it.

Prints one JSON object (counts per target). Exit code 0 when every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

from speedtronic.checkpoint import CheckpointManager  # noqa: E402
from speedtronic.config import ConfigError, DistributedConfig  # noqa: E402
from speedtronic.diloco.codec import delta_to_bytes  # noqa: E402
from speedtronic.diloco.directory import DirectoryTransport  # noqa: E402
from speedtronic.diloco.exchange import RoundSettings  # noqa: E402
from speedtronic.diloco.hub import HubClient  # noqa: E402
from speedtronic.diloco.master import RoundMaster  # noqa: E402
from speedtronic.folder_lock import LOCK_FILE, FolderLock  # noqa: E402
from speedtronic.retry import RetryPolicy  # noqa: E402
from speedtronic.testing.hub_server import HubEmulator, LfsConfig  # noqa: E402

WIDTH = 250_000  # floats in the checkpoint tensor (1 MB): a write takes a while
NODE = "crash-node"
BAD = "crash-bad"  # every contribution of this node is damaged in the exchange


def _retry() -> RetryPolicy:
    return RetryPolicy(initial=0.001, maximum=0.005, attempts=3, timeout=10.0)


#: The Hub emulator of ``--exchange hub-lfs`` (empty: the exchange is a shared directory).
_HUB: list[HubEmulator] = []


def _exchange(root: Path) -> DirectoryTransport | HubClient:
    """The exchange rooted at ``root``: a shared directory, or one Hub repository per root."""
    if not _HUB:
        return DirectoryTransport(f"file://{root}", _retry())
    name = "-".join(root.parts[-2:]).replace("_", "-")
    hub = HubClient(
        f"org/{name}", endpoint=_HUB[0].url, cache_dir=root.parent / "cache", retry=_retry()
    )
    hub.create_repo()
    return hub


def _cut_bad_objects(repo_id: str, files: dict) -> None:
    """The emulator's ``on_commit`` (under its lock, as a commit lands): each large-file
    object of a ``BAD`` contribution loses its last 100 bytes (its pointer keeps the size)."""
    hub = _HUB[0]
    for path in files:
        oid = hub.repos[repo_id].lfs.get(path)
        if path.startswith(f"nodes/{BAD}/delta_") and oid is not None:
            hub.lfs.objects[oid] = hub.lfs.objects[oid][:-100]


def _orphans() -> int:
    """Objects in the emulator's storage that no committed file points to."""
    hub = _HUB[0]
    with hub.lock:
        pointed = {oid for repo in hub.repos.values() for oid in repo.lfs.values()}
        return len(set(hub.lfs.objects) - pointed)


# ----------------------------------------------------------------------------- children


def _report(fd: int, value: int) -> None:
    os.write(fd, f"{value}\n".encode())


def _checkpoint_child(root: Path, start: int, fd: int) -> None:
    FolderLock.acquire(root, command="crash-loop writer")  # held until the SIGKILL
    manager = CheckpointManager(root, keep_last=2, warn=lambda message: None)
    step = start
    while True:
        state = {"step": step, "model": {"w": torch.full((WIDTH,), float(step))}, "tag": step}
        manager.save(step, state)
        _report(fd, step)
        step += 1


def _settings() -> DistributedConfig:
    return DistributedConfig(
        outer_lr=0.7, outer_momentum=0.9, round_timeout=60.0, min_nodes=1, inner_steps=1
    )


def _initial() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64), "b": torch.ones(8)}


def _master(root: Path) -> tuple[RoundMaster, DirectoryTransport | HubClient]:
    transport = _exchange(root / "exchange")
    transport.create_repo()  # as the coordinator does before the master's first read
    master = RoundMaster(
        transport,
        _initial(),
        settings=RoundSettings.of(_settings()),
        state_dir=root / "state",
    )
    return master, transport


def _contribute(transport: DirectoryTransport | HubClient, master: RoundMaster) -> None:
    """Each node's contribution to the open round (different values every round); ``BAD``'s
    is damaged in the exchange as it lands (see :func:`_cut_bad_objects`) or written with a
    value changed after its digest was taken (a volume)."""
    label = master.outer_step
    listed = transport.list_info()
    meta = transport.global_metadata()
    for node in (NODE, BAD):
        path = f"nodes/{node}/delta_{label}.safetensors"
        if path in listed:
            continue
        scale = 0.01 * (1 + label % 7) + 1e-4 * label
        delta = {"w": torch.full((64,), scale), "b": torch.full((8,), -scale)}
        header = {
            "node_id": node,
            "round_index": label,
            "local_step": label + 1,
            "base_outer_step": label,
        }
        run = {"run_id": meta.run_id if meta else "", "instance": f"{node}-1"}
        owner = {"instance": f"{node}-1", "state": "training"}
        if node == BAD and not _HUB:  # the last value's lowest bit flipped: same size
            data = bytearray(delta_to_bytes(delta, **header, extra=run))
            data[-4] ^= 0x01
            owner_file = f"nodes/{node}/owner.json"
            transport.commit({path: bytes(data), owner_file: json.dumps(owner).encode()})
            continue
        transport.upload_delta(delta, **header, owner=owner, metadata=run)


def _master_child(root: Path, fd: int) -> None:
    master, transport = _master(root)
    master.reconcile()
    while True:
        _contribute(transport, master)
        if master.poll_once():
            _report(fd, master.outer_step)


def _publish_state(step: int) -> dict[str, torch.Tensor]:
    # 4 MB: a publish spends most of its time writing, so most random kills land inside one
    # (at 250 kB, 3 of 12 loops measured here had none of their 20 kills inside a write; at
    # 4 MB the fewest of 12 was 5)
    return {"w": torch.full((4 * WIDTH,), float(step)), "step": torch.tensor(step)}


def _publish_child(root: Path, start: int, fd: int) -> None:
    transport = _exchange(root)
    step = start
    while True:
        transport.publish_global(_publish_state(step), outer_step=step, ledger={NODE: step})
        _report(fd, step)
        step += 1


# ----------------------------------------------------------------------------- parent


def _kill_at_random(child, rng: random.Random, low: float, high: float) -> int:
    """Fork ``child(fd)``, SIGKILL it after a random delay; the last value it reported."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write until killed; never return into the parent's code
        os.close(read_fd)
        try:
            child(write_fd)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)
    os.close(write_fd)
    time.sleep(rng.uniform(low, high))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    data = b""
    while True:
        ready, _, _ = select.select([read_fd], [], [], 5.0)
        chunk = os.read(read_fd, 65536) if ready else b""
        if not chunk:
            break
        data += chunk
    os.close(read_fd)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise AssertionError(f"the writer exited on its own (status {status})")
    values = [int(line) for line in data.decode().split()]
    return values[-1] if values else -1


def _temps(root: Path) -> int:
    return sum(1 for path in root.rglob(".*") if ".tmp-" in path.name)


def run_checkpoint(root: Path, kills: int, rng: random.Random) -> dict[str, int]:
    counts = {"kills": 0, "recovered": 0, "mid_write": 0, "fallbacks": 0, "empty": 0}
    counts["stale_locks"] = 0
    start = 1
    for _ in range(kills):
        child = lambda fd, first=start: _checkpoint_child(root, first, fd)  # noqa: E731
        done = _kill_at_random(child, rng, 0.01, 0.12)
        counts["kills"] += 1
        counts["mid_write"] += int(_temps(root) > 0)
        counts["stale_locks"] += int((root / LOCK_FILE).exists())
        try:  # the dead writer's lock file is not held: the next start takes the folder
            FolderLock.acquire(root, command="crash-loop restart").release()
        except ConfigError as exc:
            raise AssertionError(f"the restart could not take the folder over: {exc}") from None
        warnings: list[str] = []
        state = CheckpointManager(root, warn=warnings.append).load_latest()
        counts["fallbacks"] += len(warnings)
        if state is None:
            assert done < start, f"save of step {done} returned but nothing loads"
            counts["empty"] += 1
            continue
        step = int(state["step"])
        assert max(done, start - 1) <= step <= max(done, start - 1) + 1, (done, step)
        assert torch.equal(state["model"]["w"], torch.full((WIDTH,), float(step)))
        assert state["tag"] == step
        counts["recovered"] += 1
        start = step + 1
    counts["last_step"] = start - 1
    return counts


def run_master(root: Path, kills: int, rng: random.Random) -> dict[str, int]:
    counts = {"kills": 0, "recovered": 0, "torn_local": 0, "torn_publish": 0, "empty": 0}
    counts.update(behind_published=0, stuck=0, refused=0)
    highest = -1
    for _ in range(kills):
        low, high = (0.1, 0.8) if _HUB else (0.05, 0.4)  # a Hub round takes longer
        done = _kill_at_random(lambda fd: _master_child(root, fd), rng, low, high)
        counts["kills"] += 1
        highest = max(highest, done)
        master, transport = _master(root)  # the next start
        remote = transport.global_metadata()
        if remote is None and not master.agreement.has_local_state:
            assert highest < 0, "a round closed but nothing was published or persisted"
            counts["empty"] += 1
            continue
        published, weights = transport.fetch_global()
        counts["torn_publish"] += int(
            remote is not None and published.outer_step != remote.outer_step
        )
        if master.agreement.has_local_state:
            assert master.outer_step >= highest, (master.outer_step, highest)
            assert published.outer_step in (master.outer_step, master.outer_step + 1)
            if published.outer_step == master.outer_step:
                for key, value in weights.items():
                    assert torch.equal(master.global_state[key], value.to(torch.float32)), key
        else:
            counts["torn_local"] += 1  # unreadable local state: rebuilt from the global
        master.reconcile()
        assert master.outer_step >= highest, (master.outer_step, highest)
        assert BAD not in master.ledger, "a damaged contribution was aggregated"
        counts["recovered"] += 1
        # After a publish torn between its files the master comes back at the newest global
        # whose ledger landed (weights alone are recomputed: the round's files are still
        # there and the ledger does not count them), and its next round closes.
        counts["behind_published"] += int(master.outer_step < published.outer_step)
        _contribute(transport, master)
        closed = master.poll_once()
        counts["stuck"] += int(not closed)
        assert closed, f"the round after restart {counts['kills']} never closed"
        assert BAD not in master.ledger, "a damaged contribution was aggregated"
        bad = f"nodes/{BAD}/delta_{master.outer_step - 1}.safetensors"
        counts["refused"] += int(bad not in transport.list_info())  # refused and pruned
        counts["last_step"] = master.outer_step
    return counts


def run_publish(root: Path, kills: int, rng: random.Random) -> dict[str, int]:
    counts = {"kills": 0, "recovered": 0, "torn_publish": 0, "mid_write": 0, "empty": 0}
    if _HUB:
        counts["orphans"] = 0
    transport = _exchange(root)
    start = 0
    for _ in range(kills):
        before = _orphans() if _HUB else _temps(root)
        child = lambda fd, first=start: _publish_child(root, first, fd)  # noqa: E731
        done = _kill_at_random(child, rng, *((0.05, 0.6) if _HUB else (0.01, 0.12)))
        counts["kills"] += 1
        if _HUB:
            counts["orphans"] += int(_orphans() > before)
        else:
            counts["mid_write"] += int(_temps(root) > before)
        record = transport.global_metadata()
        if record is None:
            assert done < start, "a publish returned but no record exists"
            counts["empty"] += 1
            continue
        meta, state = transport.fetch_global()
        counts["torn_publish"] += int(meta.outer_step != record.outer_step)
        step = meta.outer_step
        assert max(done, start - 1) <= step <= max(done, start - 1) + 1, (done, step)
        assert torch.equal(state["w"], torch.full((4 * WIDTH,), float(step)))
        assert int(state["step"]) == step
        counts["recovered"] += 1
        start = step + 1
    counts["last_step"] = start - 1
    return counts


def main(argv: list[str] | None = None) -> int:
    """Run the loop; print one JSON object with the counts; exit 1 on a failed check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per target")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--exchange",
        choices=("directory", "hub-lfs"),
        default="directory",
        help="what the master and publish targets write to",
    )
    parser.add_argument("--targets", default="checkpoint,master,publish")
    args = parser.parse_args(argv)
    if args.exchange == "hub-lfs":  # threads in this process only: forked writers use HTTP
        _HUB.append(HubEmulator(0, lfs=LfsConfig(threshold=256)).start())
        _HUB[0].on_commit = _cut_bad_objects
    targets = args.targets.split(",")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    result: dict[str, Any] = {"seed": seed, "exchange": args.exchange}
    started = time.monotonic()
    try:
        for name, run in (
            ("checkpoint", run_checkpoint),
            ("master", run_master),
            ("publish", run_publish),
        ):
            if name not in targets:
                continue
            root = args.workdir / name
            root.mkdir(parents=True, exist_ok=True)
            began = time.monotonic()
            result[name] = run(root, args.kills, rng)
            result[name]["seconds"] = round(time.monotonic() - began, 1)
    except AssertionError as exc:
        result["failure"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    result["seconds"] = round(time.monotonic() - started, 1)
    if _HUB:
        counts = _HUB[0].stats()["counts"]
        result["hub_requests"] = {k: v for k, v in counts.items() if "lfs" in k or "storage" in k}
        _HUB[0].stop()
    print(json.dumps(result))
    return 1 if "failure" in result else 0


if __name__ == "__main__":
    sys.exit(main())
