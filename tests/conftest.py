"""Suite-wide settings: CPU only, few threads (CI machines have two cores); no process a test
started outlives it."""

from __future__ import annotations

import os

import pytest
from process_support import STARTED, reap

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "0")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

for _name in list(os.environ):
    # A developer's own SPEEDTRONIC_* variables must not leak into config tests.
    if _name.startswith("SPEEDTRONIC_") or _name in {"HF_TOKEN", "HF_USERNAME"}:
        del os.environ[_name]


def pytest_configure(config):
    """Keep torch to one intra-op thread when a test imports it."""
    try:
        import torch
    except ImportError:  # the config tests run without torch too
        return
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reap_started_processes():
    """Kill and collect every process in `process_support.STARTED` still alive after a test,
    even when it failed."""
    yield
    reap(STARTED)
