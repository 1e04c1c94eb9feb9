"""Local "rehearsal" of containers: processes, HTTP probes, scrapes, and the DiLoCo round check.

A rehearsal starts a container's command as a local process with exactly that container's
environment, mapping what only exists inside a container:

* mount targets (``/data``, ``/config``, ``/run/secrets``, ``/tmp``) -> temporary directories
  (or the repo's ``configs/`` for a read-only bind of it); every occurrence of a mount target
  in the environment and the command line is rewritten;
* the container's own network namespace -> a free local port (``SPEEDTRONIC_METRICS__PORT``);
* hostname / pod name -> distinct values (``HOSTNAME``; Kubernetes fieldRefs);
* the image's ``/opt/venv/bin`` -> this interpreter's bin directory (``speedtronic`` on PATH).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from process_support import free_port as free_port  # re-exported for the rehearsal tests

VENV_BIN = str(Path(sys.executable).parent)


# -- processes ---------------------------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; HTTP errors are returned, connection errors give status 0."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        return 0, str(exc)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics parsed with prometheus_client's text parser: {(sample, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, body
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def scrape_value(port: int, name: str, **labels: str) -> float | None:
    """One sample's value from a live /metrics; None while the server or series is not up."""
    status, _ = http_get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return None
    try:
        return metric(scrape(port), name, **labels)
    except KeyError:
        return None


def metric(samples: Mapping[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """Sum of a sample over every series matching `labels`; KeyError when there is none."""
    values = [
        v
        for (sample, keys), v in samples.items()
        if sample == name and all(dict(keys).get(k) == w for k, w in labels.items())
    ]
    if not values:
        raise KeyError(name)
    return sum(values)


def rewrite_paths(text: str, mounts: Mapping[str, str]) -> str:
    """Replace every mount target at a path boundary by its local directory, in one pass (a
    replacement is never rewritten again; the longest target wins)."""
    if not mounts:
        return text
    targets = sorted(mounts, key=len, reverse=True)
    pattern = "|".join(re.escape(t) for t in targets)
    return re.sub(f"({pattern})(?=/|$|\"|'|\\s)", lambda m: mounts[m.group(1)], text)


@dataclass
class Rehearsal:
    """One container started as a local process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    port: int
    mounts: dict[str, str] = field(default_factory=dict)
    output_dir: str = ""
    log: Path | None = None
    process: subprocess.Popen | None = None

    def start(self, log_dir: Path) -> Rehearsal:
        """Start the process, stdout+stderr into ``<log_dir>/<name>.log``."""
        self.log = log_dir / f"{self.name}.log"
        handle = self.log.open("wb")
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()
        return self

    def output(self) -> str:
        """Everything the process printed so far."""
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def node_id(self) -> str | None:
        """The worker slot this process claimed (from its log), else its configured node id."""
        match = re.search(r"worker slot (worker-\d+) claimed", self.output())
        if match:
            return match.group(1)
        return self.env.get("SPEEDTRONIC_NODE_ID") or self.env.get(
            "SPEEDTRONIC_DISTRIBUTED__NODE_ID"
        )

    def final_output_dir(self) -> Path:
        """``run.output_dir`` with ``{node_id}`` resolved as the entrypoint resolved it."""
        configured = self.output_dir or self.env["SPEEDTRONIC_RUN__OUTPUT_DIR"]
        if "{node_id}" in configured:
            node_id = self.node_id()
            assert node_id, f"{self.name}: no node id in its log"
            configured = configured.replace("{node_id}", node_id)
        return Path(configured)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; the exit code (the process group is killed if it does not stop)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for an exit already asked for (one SIGTERM, as kubelet sends); the exit code
        (the process group is killed if it does not stop in ``timeout`` seconds)."""
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        """Kill the process group if it is still running (test cleanup)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def wait_until(predicate, timeout: float, what: str, processes: Iterable[Rehearsal] = ()):
    """Poll `predicate` until truthy; fail naming `what` (with process output) on timeout."""
    processes = list(processes)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for proc in processes:
            if proc.process is not None and proc.process.poll() is not None:
                raise AssertionError(
                    f"{proc.name} exited with {proc.process.returncode} while waiting for {what}:"
                    f"\n{proc.output()[-4000:]}"
                )
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.output()[-3000:]}" for p in processes)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def base_env(tmp: Path) -> dict[str, str]:
    """What every rehearsed container gets besides its own environment (the image's runtime)."""
    env = {
        "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp / "home"),
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    (tmp / "home").mkdir(exist_ok=True)
    return env


# -- the rehearsal itself ----------------------------------------------------------------------
# Time scaling only (documented deviations from the manifests' environment): train until
# SIGTERM, exchange deltas every few steps, poll fast, log little.
SPEED_ENV = {
    "SPEEDTRONIC_RUN__MAX_STEPS": "100000",
    "SPEEDTRONIC_DISTRIBUTED__INNER_STEPS": "3",
    "SPEEDTRONIC_DISTRIBUTED__POLL_INTERVAL": "0.5",
    "SPEEDTRONIC_LOGGING__EVERY_STEPS": "50",
}

# The Hub configs train a bigger model; the Hub rehearsals shrink it (time scaling only).
SMALL_MODEL_ENV = {
    "SPEEDTRONIC_MODEL__VOCAB_SIZE": "128",
    "SPEEDTRONIC_MODEL__MAX_SEQ_LEN": "32",
    "SPEEDTRONIC_MODEL__N_LAYER": "2",
    "SPEEDTRONIC_MODEL__D_MODEL": "64",
    "SPEEDTRONIC_DATA__MICRO_BATCH_SIZE": "2",
    "SPEEDTRONIC_DATA__TARGET_BATCH_SIZE": "2",
    "SPEEDTRONIC_CHECKPOINT__EVERY_STEPS": "20",
}

MASTER_MOVING = [
    "speedtronic_diloco_rounds_total",
    "speedtronic_diloco_outer_step",
    "speedtronic_diloco_deltas_found_total",
    "speedtronic_diloco_deltas_included_total",
    "speedtronic_train_steps_total",
]
WORKER_MOVING = [
    "speedtronic_diloco_uploads_total",
    "speedtronic_diloco_upload_bytes_total",
    "speedtronic_diloco_upload_seconds_count",
    "speedtronic_train_steps_total",
]


def rehearse(processes: list[Rehearsal], log_dir: Path, probe) -> None:
    """Start `processes` (a master first, then workers); assert a DiLoCo round completes, the
    probe paths answer 200, the DiLoCo series move, and SIGTERM stops each with exit 0 and a
    final checkpoint under its ``SPEEDTRONIC_RUN__OUTPUT_DIR``.

    Args:
        processes: ``master`` first; the rest are workers.
        log_dir: where each process's output goes.
        probe: ``probe(proc)`` asserts the manifest's own health checks/probes pass while the
            process runs (after the round); /healthz and /readyz are always checked.
    """
    master, workers = processes[0], processes[1:]
    try:
        for proc in processes:
            proc.start(log_dir)
        every = list(processes)
        for proc in processes:
            wait_until(
                lambda p=proc: http_get(p.url("/readyz"))[0] == 200,
                300,
                f"{proc.name} ready",
                every,
            )
        before = {proc.name: scrape(proc.port) for proc in processes}

        def round_done() -> bool:
            included = scrape_value(master.port, "speedtronic_diloco_deltas_included_total") or 0
            pulled = [scrape_value(w.port, "speedtronic_diloco_outer_step") or 0 for w in workers]
            return included >= 1 and min(pulled) >= 1

        wait_until(round_done, 300, "a DiLoCo round to complete and reach every worker", every)
        for proc in processes:
            moving = MASTER_MOVING if proc is master else WORKER_MOVING

            def moved(p=proc, names=moving) -> bool:
                now = scrape(p.port)
                return all(metric(now, n) > metric(before[p.name], n) for n in names)

            wait_until(moved, 300, f"{proc.name}'s DiLoCo series to move", every)
            for path in ("/healthz", "/readyz"):
                status, body = http_get(proc.url(path))
                assert status == 200, (proc.name, path, body)
            probe(proc)
        for worker in workers:
            assert (scrape_value(worker.port, "speedtronic_diloco_global_pulls_total") or 0) >= 1
        for proc in [*workers, master]:
            code = proc.terminate(timeout=180)
            assert code == 0, f"{proc.name} exited {code}:\n{proc.output()[-4000:]}"
            assert "SIGTERM received" in proc.output()
            output_dir = proc.final_output_dir()
            assert list(output_dir.rglob("latest.json")), f"{proc.name}: no final checkpoint"
    finally:
        for proc in processes:
            proc.kill()


# -- self-checks ---------------------------------------------------------------------------------
def test_rewrite_paths_only_at_path_boundaries():
    mounts = {"/data": "/tmp/x/data", "/config": "/repo/configs"}
    assert rewrite_paths("file:///data/exchange", mounts) == "file:///tmp/x/data/exchange"
    assert rewrite_paths("/config/diloco.yaml", mounts) == "/repo/configs/diloco.yaml"
    assert rewrite_paths("/database", mounts) == "/database"
    assert rewrite_paths('OUT="/data/runs/$H" exec', mounts) == 'OUT="/tmp/x/data/runs/$H" exec'
    nested = {"/data": "/tmp/p/data", "/tmp": "/tmp/p/tmp"}
    assert rewrite_paths("/data/x /tmp", nested) == "/tmp/p/data/x /tmp/p/tmp"
