"""Pytest fixtures for DumbDiLoCo tests: a live Hub emulator and ready-made transports.

Import them (and the helpers) explicitly in a test module::

    from hub_emulator_fixtures import hub_emulator, make_transport  # noqa: F401
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from speedtronic.retry import RetryPolicy
from speedtronic.testing.hub_server import FaultConfig, HubEmulator

#: The token every emulator in the suite requires; tests grep outputs for it.
TEST_TOKEN = "hf_TESTtoken_5ecret_do_not_leak_8472"


def fast_retry(attempts: int = 4, sleeps: list | None = None) -> RetryPolicy:
    """A retry policy with millisecond backoff (sleeps recorded in ``sleeps`` when given)."""
    sleeper = sleeps.append if sleeps is not None else (lambda s: None)
    return RetryPolicy(initial=0.01, maximum=0.05, attempts=attempts, timeout=10.0, sleeper=sleeper)


@contextlib.contextmanager
def running_emulator(seed: int, **options) -> Iterator[HubEmulator]:
    """An emulator started on 127.0.0.1 (random port) that requires ``TEST_TOKEN``, its
    faults seeded with ``seed``, with ``options`` (``lfs=``, ...); stopped on exit."""
    emulator = HubEmulator(0, token=TEST_TOKEN, faults=FaultConfig(seed=seed), **options).start()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def hub_emulator():
    """A started emulator on 127.0.0.1 (random port) that requires ``TEST_TOKEN``."""
    with running_emulator(1234) as emulator:
        yield emulator


@pytest.fixture
def make_transport(tmp_path, hub_emulator):
    """``make_transport(kind)`` -> a transport of kind ``directory`` or ``hub`` (emulated)."""

    def factory(kind: str, *, retry: RetryPolicy | None = None, repo: str = "org/run"):
        retry = retry or fast_retry()
        if kind == "directory":
            from speedtronic.diloco.directory import DirectoryTransport

            return DirectoryTransport(f"file://{tmp_path / 'repo'}", retry)
        from speedtronic.diloco.hub import HubClient

        return HubClient(
            repo,
            token=TEST_TOKEN,
            endpoint=hub_emulator.url,
            cache_dir=tmp_path / "cache",
            retry=retry,
        )

    return factory


def upload_then_poll(
    hub,
    master,
    events: list,
    *,
    rounds: int,
    width: int,
    nodes: Sequence[str] = ("a", "b", "c"),
    pause: float = 0.05,
) -> None:
    """Round by round, every node of ``nodes`` uploads its delta through ``hub`` (node ``i``
    of round ``r``: ``r * len(nodes) + i + 1`` in each of ``width`` elements of ``"w"``), then
    ``master`` is polled every ``pause`` seconds until the round closes (at most 120 s; the
    failure shows the last ``events``)."""
    for r in range(rounds):
        run = hub.global_metadata().run_id
        for i, node in enumerate(nodes):
            hub.upload_delta(
                {"w": torch.full((width,), float(r * len(nodes) + i + 1))},
                node_id=node,
                round_index=r,
                local_step=r,
                base_outer_step=r,
                owner={"instance": node, "state": "training"},
                metadata={"run_id": run, "instance": node},
            )
        deadline = time.monotonic() + 120
        while not master.poll_once():
            assert time.monotonic() < deadline, f"round {r} never closed: {events[-5:]}"
            time.sleep(pause)
