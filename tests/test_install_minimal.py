"""``pip install -e .`` (no extras) is enough to run (README, issue 29): every command a run
needs works with only the package's own dependencies importable, and the commands that need
an extra (``export``: transformers, ``plot``: matplotlib) say which one.

The installed distributions outside the dependency closure of ``speedtronic`` (the dev, bench,
plot and logging extras: transformers, matplotlib, wandb, tensorboard, pytest, ...) are made
unimportable in the child processes, which is what a machine with only ``pip install -e .``
has.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")
BLOCKER = """
import importlib.machinery, os, runpy, sys
BLOCKED = set(os.environ["BLOCKED_MODULES"].split(","))
class NotInstalled(importlib.machinery.PathFinder):  # finds nothing of BLOCKED, like no install
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return super().find_spec(name, path, target)
sys.meta_path = [NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
sys.argv = ["speedtronic", *sys.argv[1:]]
runpy.run_module("speedtronic", run_name="__main__")
"""


def _closure(name: str, seen: set[str]) -> set[str]:
    """``name`` and every distribution it requires, transitively, without extras."""
    key = name.lower().replace("_", "-")
    if key in seen:
        return seen
    seen.add(key)
    try:
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return seen
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        _closure(requirement.name, seen)
    return seen


def _blocked_modules() -> str:
    needed = _closure("speedtronic", set())
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if module.startswith("_") or module in sys.stdlib_module_names:
            continue
        if not any(d.lower().replace("_", "-") in needed for d in dists):
            blocked.add(module)
    blocked -= {"speedtronic"}
    assert {"transformers", "matplotlib", "pytest"} <= blocked, sorted(blocked)
    return ",".join(sorted(blocked))


@pytest.fixture(scope="module")
def blocked() -> str:
    try:
        metadata.distribution("speedtronic")
    except metadata.PackageNotFoundError:
        pytest.skip("speedtronic is not installed (pip install -e .): no dependency list")
    return _blocked_modules()


def _cli(tmp_path: Path, blocked: str, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_")}
    env.pop("HF_TOKEN", None)
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        BLOCKED_MODULES=blocked,
        SPEEDTRONIC_SECRETS_DIR=str(tmp_path / "secrets"),
        SPEEDTRONIC_DISTRIBUTED__REPO_ID=f"file://{tmp_path}/exchange",
        SPEEDTRONIC_METRICS__PORT="0",
    )
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_the_run_commands_need_no_extra(tmp_path, blocked) -> None:
    out = str(tmp_path / "out")
    (tmp_path / "notes.txt").write_text("a few words of text to tokenize\n" * 50)
    for argv in (
        ("run", "--max-steps", "20"),  # the embedded main job
        ("validate", "--config", SMOKE),
        ("train", "--config", SMOKE, "--max-steps", "4", "--output-dir", out),
        ("eval", "--config", SMOKE, "--output-dir", out),
        (
            "sample",
            "--config",
            SMOKE,
            "--output-dir",
            out,
            "--prompt",
            "a",
            "--max-new-tokens",
            "4",
        ),
        ("prepare", "-i", "notes.txt", "-o", "tokens", "--no-progress"),
    ):
        done = _cli(tmp_path, blocked, *argv)
        assert done.returncode == 0, f"{argv}\n{done.stdout[-2000:]}\n{done.stderr}"


def test_the_commands_that_need_an_extra_name_it(tmp_path, blocked) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"event": "train_step", "step": 1, "loss": 1.0, "run_id": "r"}\n')
    done = _cli(tmp_path, blocked, "plot", str(events))
    assert done.returncode != 0 and "pip install 'speedtronic[plot]'" in done.stderr
    done = _cli(
        tmp_path, blocked, "export", "--config", SMOKE, "-o", str(tmp_path / "hf"),
        "--output-dir", str(tmp_path / "none"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "transformers" in done.stderr or "no checkpoint" in done.stderr, done.stderr
