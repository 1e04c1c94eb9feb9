"""Fixtures of the real container tier: a reachable engine (else every test skips, naming why)
and the image, built once per session from the repository as it is."""

from __future__ import annotations

import pytest
from container_support import build_image, report, unavailable

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
    report("image", measured)
    return IMAGE
