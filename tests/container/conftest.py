"""Fixtures of the real container tier: a reachable engine (else every test skips, naming why)
and the image, built once per session from the repository as it is. Each test's duration goes
into the CONTAINER_TEST_REPORT file beside the build measurements."""

from __future__ import annotations

import pytest
from container_support import build_image, unavailable
from container_support import report as record

IMAGE = "speedtronic:ci-test"


@pytest.fixture(scope="session")
def engine() -> None:
    """Skip (with the reason) unless a Docker engine and the Compose v2 plugin answer."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def image(engine) -> str:
    """The repository's image, built with the classic builder; its tag."""
    measured = build_image(IMAGE)
    record("image", measured)
    return IMAGE


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record how long each container test took (setup, which may build the image, apart)."""
    if report.when in ("setup", "call") and report.outcome != "skipped":
        name = report.nodeid.rsplit("::", 1)[-1]
        record(f"seconds.{report.when}.{name}", round(report.duration, 1))
