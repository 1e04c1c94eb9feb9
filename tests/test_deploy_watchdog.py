"""A stalled training loop ends `speedtronic run` with exit code 1 (so `restart: on-failure`
and Kubernetes restart it), while /healthz keeps reporting the stall for probes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from test_deploy_support import REPO

from speedtronic.metrics.server import StallWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_fires_once_when_armed_and_stale():
    clock, fired = Clock(), []
    beat = {"t": 100.0}
    armed = {"on": False}
    dog = StallWatchdog(
        lambda: beat["t"], 10.0, fired.append, armed=lambda: armed["on"], clock=clock
    )
    clock.now = 150.0
    assert not dog.check(), "not armed: start-up and graceful stops never count"
    armed["on"] = True
    beat["t"] = 145.0
    assert not dog.check()
    clock.now = 156.0
    assert dog.check() and fired == [11.0]
    clock.now = 200.0
    assert not dog.check() and len(fired) == 1


def test_watchdog_counts_from_its_start_before_the_first_heartbeat():
    clock, fired = Clock(), []
    dog = StallWatchdog(lambda: None, 5.0, fired.append, clock=clock)
    clock.now = 104.0
    assert not dog.check()
    clock.now = 106.0
    assert dog.check() and fired == [6.0]


STALLING_RUN = textwrap.dedent(
    """
    import sys, time
    from types import SimpleNamespace
    from speedtronic import entrypoint
    from speedtronic.config import resolve_config
    from speedtronic.train.parallel import SingleProcess

    class StuckTrainer:
        coordinator = None
        last_heartbeat = None
        parallel = SingleProcess()
        def __init__(self):  # what the start-up lines read of every Trainer
            import torch
            from speedtronic.train.precision import resolve_precision
            self.logger = SimpleNamespace(hooks=[])
            self.model, self.device = torch.nn.Linear(2, 2), torch.device("cpu")
            self.precision = resolve_precision(None, self.device)
        def request_stop(self, reason):
            pass
        def fit(self):
            for hook in self.logger.hooks:
                (getattr(hook, "on_event", None) or hook)("train_start", {"start_step": 0})
            time.sleep(600)  # a loop that never comes back (deadlock, hung I/O, ...)

    entrypoint._build = lambda config, resume: (StuckTrainer(), None)
    resolved = resolve_config(
        sys.argv[1],
        environ={
            "SPEEDTRONIC_METRICS__ENABLED": "false",
            "SPEEDTRONIC_METRICS__STALL_SECONDS": "1",
            "SPEEDTRONIC_LOGGING__FORMAT": "json",
        },
        secrets_dir="/nonexistent",
    )
    sys.exit(entrypoint.run_command(resolved))
    """
)


def test_a_stalled_loop_ends_the_process_with_exit_code_1(tmp_path):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", STALLING_RUN, str(REPO / "configs/smoke.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert '"event": "stalled"' in result.stdout, result.stdout[-2000:]
