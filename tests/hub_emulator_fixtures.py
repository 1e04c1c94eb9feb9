"""Pytest fixtures for DumbDiLoCo tests: a live Hub emulator and ready-made transports.

Import them explicitly in a test module::

    from hub_emulator_fixtures import hub_emulator, make_transport  # noqa: F401
"""

from __future__ import annotations

import pytest

from speedtronic.retry import RetryPolicy
from speedtronic.testing.hub_server import FaultConfig, HubEmulator

#: The token every emulator in the suite requires; tests grep outputs for it.
TEST_TOKEN = "hf_TESTtoken_5ecret_do_not_leak_8472"


def fast_retry(attempts: int = 4, sleeps: list | None = None) -> RetryPolicy:
    """A retry policy with millisecond backoff (sleeps recorded in ``sleeps`` when given)."""
    sleeper = sleeps.append if sleeps is not None else (lambda s: None)
    return RetryPolicy(initial=0.01, maximum=0.05, attempts=attempts, timeout=10.0, sleeper=sleeper)


@pytest.fixture
def hub_emulator():
    """A started emulator on 127.0.0.1 (random port) that requires ``TEST_TOKEN``."""
    emulator = HubEmulator(0, token=TEST_TOKEN, faults=FaultConfig(seed=1234)).start()
    try:
        yield emulator
    finally:
        emulator.stop()


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
