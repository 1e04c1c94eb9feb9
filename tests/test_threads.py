"""runtime.threads: what a process may use (affinity, cgroup v1/v2 quota), how many training
processes share it (LOCAL_WORLD_SIZE, the host's sibling registry), and what a started
``speedtronic train`` logs and really uses."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.train.cpus import (
    cgroup_cpu_quota,
    local_world_size,
    omp_threads,
    parse_cfs_quota,
    parse_cpu_max,
    plan_threads,
)
from speedtronic.train.threads import SiblingRegistry, ThreadBudget, registry_dir

REPO = Path(__file__).resolve().parents[1]
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def fake_root(tmp_path: Path, proc_cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A folder standing for ``/``: proc/self/{cgroup,mountinfo} and the cgroup files."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


# --------------------------------------------------------------------------- cgroup files
def test_cpu_max_and_cfs_quota_parse_to_cpus() -> None:
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cpu_max("max 100000") is None
    assert parse_cpu_max("") is None
    assert parse_cfs_quota("50000", "100000") == 0.5
    assert parse_cfs_quota("-1", "100000") is None
    assert parse_cfs_quota("junk", "100000") is None


def test_cgroup_v2_quota_is_the_smallest_on_the_path_to_the_root(tmp_path: Path) -> None:
    """A pod limit above an unlimited container counts; a looser grandparent does not."""
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/kubepods/cpu.max": "400000 100000",
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "200000 100000",
            "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000",
        },
    )
    assert cgroup_cpu_quota(root) == 2.0


def test_cgroup_v2_namespace_sees_its_own_folder_as_root(tmp_path: Path) -> None:
    """docker --cpus 1 with a cgroup namespace: /proc/self/cgroup says 0::/."""
    root = fake_root(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "100000 100000"})
    assert cgroup_cpu_quota(root) == 1.0


def test_cgroup_v1_quota_under_a_mount_rooted_at_the_container(tmp_path: Path) -> None:
    """cgroup v1 without a namespace: the path repeats the mount's root, which is stripped."""
    mountinfo = (
        "40 30 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup "
        "rw,cpu,cpuacct\n"
        "41 30 0:36 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    )
    root = fake_root(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
        mountinfo,
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "150000",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
        },
    )
    assert cgroup_cpu_quota(root) == 1.5


def test_hybrid_host_reads_the_v1_cpu_controller(tmp_path: Path) -> None:
    """Hybrid: v1 holds the cpu controller, the v2 mount has no cpu.max; -1 is no limit."""
    mountinfo = V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified ") + (
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    )
    files = {
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
        "sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "50000",
        "sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000",
    }
    root = fake_root(tmp_path, "1:cpu:/job\n0::/\n", mountinfo, files)
    assert cgroup_cpu_quota(root) == 0.5
    unlimited = fake_root(tmp_path / "b", "1:cpu:/\n0::/\n", mountinfo, files)
    assert cgroup_cpu_quota(unlimited) is None


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_cpu_quota(fake_root(tmp_path, "0::/a\n", V2_MOUNT, {})) is None


# --------------------------------------------------------------------------- the plan
def test_auto_divides_the_allowed_cpus_among_the_processes() -> None:
    eight = range(8)
    assert plan_threads("auto", cpus=eight, quota=None).threads == 8
    assert plan_threads("auto", cpus=eight, quota=1.5).threads == 2  # ceil of the quota
    assert plan_threads("auto", cpus=eight, quota=0.5).threads == 1
    assert plan_threads("auto", cpus=eight, quota=None, processes=3).threads == 2
    assert plan_threads("auto", cpus=eight, quota=4.0, local_world=4).threads == 1
    assert plan_threads("auto", cpus=eight, quota=None, processes=3, local_world=2).threads == 2
    assert plan_threads("auto", cpus=[0, 1], quota=None, processes=3).threads == 1
    plan = plan_threads("auto", cpus=[0, 1], quota=1.0, processes=3)
    assert plan.describe() == (
        "threads: 1 (auto: 2 CPUs in affinity, cgroup quota 1, 3 training processes on this host)"
    )


def test_explicit_count_beats_omp_num_threads_which_beats_auto() -> None:
    env = plan_threads("auto", cpus=range(8), quota=None, omp=3)
    assert (env.threads, env.source) == (3, "OMP_NUM_THREADS")
    assert env.describe() == "threads: 3 (OMP_NUM_THREADS=3 in the environment)"
    explicit = plan_threads(5, cpus=range(8), quota=1.0, omp=3, processes=4)
    assert (explicit.threads, explicit.source) == (5, "runtime.threads")
    assert "OMP_NUM_THREADS=3 not used" in explicit.describe()


def test_environment_values_are_read_strictly() -> None:
    assert omp_threads({"OMP_NUM_THREADS": "4"}) == 4
    assert omp_threads({"OMP_NUM_THREADS": "4,2"}) == 4  # nested levels: the outer one
    assert omp_threads({"OMP_NUM_THREADS": "0"}) is None
    assert omp_threads({"OMP_NUM_THREADS": "many"}) is None
    assert omp_threads({}) is None
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_world_size({"LOCAL_WORLD_SIZE": "-2"}) == 1
    assert local_world_size({}) == 1


def test_odd_or_absurd_environment_counts_are_ignored_or_capped_with_a_warning(caplog) -> None:
    """``²`` is a digit to ``str.isdigit`` but not to ``int`` (issue 39, item 12: a traceback
    at start-up); 5000 threads on a few CPUs would be built by torch as asked."""
    caplog.set_level(logging.WARNING, logger="speedtronic.threads")
    for value in ("²", "٣", "-2", "0", "many", "9" * 5000):
        for read in (omp_threads, local_world_size):
            name = "OMP_NUM_THREADS" if read is omp_threads else "LOCAL_WORLD_SIZE"
            got = read({name: value})
            assert got in (None, 1) if len(value) < 10 else got == 10**9
    assert "OMP_NUM_THREADS='²' in the environment is not a positive integer; ignored" in (
        caplog.text
    )
    assert "LOCAL_WORLD_SIZE='-2' in the environment is not a positive integer" in caplog.text
    plan = plan_threads("auto", cpus=range(2), quota=None, omp=5000)
    assert (
        plan.threads == 2
        and plan.capped == "OMP_NUM_THREADS=5000 is more than the 2 CPUs in affinity"
    )
    assert plan.describe() == (
        "threads: 2 (OMP_NUM_THREADS=5000 in the environment, capped at the 2 CPUs in affinity)"
    )
    plan = plan_threads("auto", cpus=range(2), quota=None, local_world=5000)
    assert (plan.threads, plan.processes) == (1, 2) and "LOCAL_WORLD_SIZE=5000" in plan.capped
    caplog.clear()
    applied: list[int] = []
    ThreadBudget.start("auto", {"OMP_NUM_THREADS": "5000"}, registry=FakeRegistry(1),
                       cpus=lambda: frozenset({0, 1}), quota=lambda: None,
                       apply=applied.append)  # fmt: skip
    assert applied == [2]
    assert "threads: OMP_NUM_THREADS=5000 is more than the 2 CPUs in affinity; capped" in (
        caplog.text
    )


def test_runtime_threads_setting_is_auto_or_a_positive_count() -> None:
    assert SpeedtronicConfig().runtime.threads == "auto"
    assert SpeedtronicConfig.from_dict({"runtime": {"threads": " Auto "}}).runtime.threads == "auto"
    assert SpeedtronicConfig.from_dict({"runtime": {"threads": "3"}}).runtime.threads == 3
    for bad in (0, -1, "lots", True, 1.5):
        # the field, what it takes (an integer > 0, or auto) and the value
        expected = r"runtime\.threads must be (greater than 0|an integer) \(or 'auto'\), got "
        with pytest.raises(ConfigError, match=expected):
            SpeedtronicConfig.from_dict({"runtime": {"threads": bad}})


# --------------------------------------------------------------------------- sibling registry
SIBLING = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from speedtronic.train.threads import SiblingRegistry
    registry = SiblingRegistry(Path(sys.argv[1]))
    assert registry.register([int(c) for c in sys.argv[2].split(",")])
    print("registered", flush=True)
    sys.stdin.read()
    """
)


def start_sibling(directory: Path, cpus: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIBLING, str(directory), cpus],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
    return proc


def test_registry_counts_live_siblings_and_drops_dead_ones(tmp_path: Path) -> None:
    directory = tmp_path / "threads"
    mine = SiblingRegistry(directory)
    assert mine.register([0, 1]) and mine.count([0, 1]) == 1
    stale = directory / "999999-dead.lock"  # a process killed without cleaning up
    stale.write_text('{"pid": 999999, "cpus": [0, 1]}')
    assert mine.count([0, 1]) == 1 and not stale.exists()
    sibling = start_sibling(directory, "0,1")
    elsewhere = start_sibling(directory, "7")  # pinned to a CPU we do not use
    try:
        assert mine.count([0, 1]) == 2
        assert mine.count([7]) == 2  # this process + the pinned one
        sibling.send_signal(signal.SIGKILL)
        sibling.wait(30)
        assert mine.count([0, 1]) == 1
        assert len(list(directory.glob("*.lock"))) == 2  # mine and the pinned one
    finally:
        for proc in (sibling, elsewhere):
            proc.kill()
            proc.wait(30)
    mine.release()
    assert SiblingRegistry(directory).count([7]) == 1  # the pinned one was killed too
    assert list(directory.glob("*.lock")) == []


def test_registry_refuses_a_folder_it_does_not_own(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "speedtronic").symlink_to(target)
    registry = SiblingRegistry(tmp_path / "speedtronic" / "threads")
    assert not registry.register([0]) and "link" in (registry.error or "")
    assert registry.count([0]) == 1
    assert registry_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "speedtronic/threads"


def test_a_fifo_named_like_an_entry_never_blocks_a_count(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: the count (every start, every refresh)
    hung for good (issue 39, item 13). Now it is opened without blocking and skipped."""
    import threading

    directory = tmp_path / "threads"
    mine = SiblingRegistry(directory)
    assert mine.register([0])
    fifo = directory / "4242-feed.lock"
    os.mkfifo(fifo)
    (directory / "4243-link.lock").symlink_to(fifo)
    counted: list[int] = []
    worker = threading.Thread(target=lambda: counted.append(mine.count([0])), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # release the blocked open before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("SiblingRegistry.count blocked on a FIFO named *.lock")
    assert counted == [1] and fifo.exists()
    mine.release()


def test_a_linked_registry_is_refused_before_anything_is_made_in_its_target(
    tmp_path: Path,
) -> None:
    """``<tmp>/speedtronic-<uid>`` planted as a link (by anyone who can write the temp
    folder): ``threads/`` used to be created in the link's target before the check."""
    target = tmp_path / "victim"
    target.mkdir()
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "speedtronic-0").symlink_to(target)
    registry = SiblingRegistry(tmp_path / "base" / "speedtronic-0" / "threads")
    assert not registry.register([0]) and "is a link" in (registry.error or "")
    assert list(target.iterdir()) == []
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "speedtronic-0").write_text("not a folder")
    registry = SiblingRegistry(tmp_path / "plain" / "speedtronic-0" / "threads")
    assert not registry.register([0]) and "not a folder" in (registry.error or "")


# --------------------------------------------------------------------------- the budget
class FakeRegistry:
    """Stands in for the host's registry: ``processes`` is what it counts."""

    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self.released = False
        self.error = None

    def register(self, cpus: object) -> bool:
        return True

    def count(self, cpus: object) -> int:
        return self.processes

    def release(self) -> None:
        self.released = True


def budget(setting, environ, registry, applied, now):
    return ThreadBudget.start(
        setting,
        environ,
        registry=registry,
        cpus=lambda: frozenset({0, 1}),
        quota=lambda: None,
        apply=applied.append,
        refresh_seconds=2.0,
        clock=lambda: now[0],
    )


def test_budget_shrinks_when_siblings_arrive_and_grows_when_they_leave(caplog) -> None:
    caplog.set_level(logging.INFO, logger="speedtronic.threads")
    registry, applied, now = FakeRegistry(1), [], [0.0]
    threads = budget("auto", {}, registry, applied, now)
    assert threads.threads == 2 and applied == [2]
    assert "threads: 2 (auto: 2 CPUs in affinity, no cgroup quota, 1 training process" in (
        caplog.text
    )
    registry.processes = 3
    threads.on_event("train_step", {"step": 1})  # not due yet
    assert threads.threads == 2
    now[0] = 2.5
    threads.on_event("train_step", {"step": 2})
    assert threads.threads == 1 and applied[-1] == 1
    assert "threads: 2 -> 1 (auto: 2 CPUs in affinity, no cgroup quota, 3 training" in caplog.text
    registry.processes = 1
    now[0] = 5.0
    threads.on_event("outer_step", {})
    assert threads.threads == 2
    threads.on_event("train_end", {})
    assert registry.released


def test_budget_keeps_an_explicit_or_environment_count(caplog) -> None:
    caplog.set_level(logging.INFO, logger="speedtronic.threads")
    for setting, environ, expected in ((3, {}, 3), ("auto", {"OMP_NUM_THREADS": "1"}, 1)):
        registry, applied, now = FakeRegistry(1), [], [0.0]
        threads = budget(setting, environ, registry, applied, now)
        registry.processes, now[0] = 4, 100.0
        threads.on_event("train_step", {"step": 1})
        assert threads.threads == expected and set(applied) == {expected}
    assert "threads: 3 (runtime.threads)" in caplog.text
    assert "threads: 1 (OMP_NUM_THREADS=1 in the environment)" in caplog.text


# --------------------------------------------------------------------------- a real process
WRAPPER = textwrap.dedent(
    """
    import atexit, runpy, sys, torch
    atexit.register(lambda: print("torch.get_num_threads()", torch.get_num_threads(), flush=True))
    sys.argv = ["speedtronic", *sys.argv[1:]]
    runpy.run_module("speedtronic", run_name="__main__")
    """
)


def train(tmp_path: Path, name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(PYTHONPATH=str(REPO), XDG_RUNTIME_DIR=str(tmp_path / "run"))
    command = [sys.executable, "-c", WRAPPER, "train", "--config", "configs/smoke.yaml"]
    command += ["--output-dir", str(tmp_path / name), "--max-steps", "3", *args]
    command += ["--set", "checkpoint.enabled=false", "--set", "eval.holdout=0"]
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def said_and_used(stdout: str) -> tuple[int, str, int]:
    said = re.findall(r"\| speedtronic\.threads \| threads: (\d+) \((.*)\)", stdout)
    used = re.findall(r"torch\.get_num_threads\(\) (\d+)", stdout)
    assert len(said) == 1 and len(used) == 1, stdout[-3000:]
    return int(said[0][0]), said[0][1], int(used[0])


def test_started_train_logs_its_threads_and_torch_uses_them(tmp_path: Path) -> None:
    """A sibling holds a place in the registry: auto gives this process half the CPUs (what
    torch would not choose by itself), and an explicit count is used as given."""
    (tmp_path / "run").mkdir(mode=0o700)
    cpus = len(os.sched_getaffinity(0))
    sibling = SiblingRegistry(registry_dir({"XDG_RUNTIME_DIR": str(tmp_path / "run")}))
    assert sibling.register(os.sched_getaffinity(0))
    try:
        said, reason, used = said_and_used(train(tmp_path, "auto"))
    finally:
        sibling.release()
    assert said == used == max(1, cpus // 2)
    assert reason.startswith(f"auto: {cpus} CPU") and "2 training processes on this host" in reason
    said, reason, used = said_and_used(train(tmp_path, "three", "--set", "runtime.threads=3"))
    assert (said, reason, used) == (3, "runtime.threads", 3)
