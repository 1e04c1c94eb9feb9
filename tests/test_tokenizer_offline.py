"""A Hub tokenizer id without network (issue 29): an answer within 5 s, never ~23 s of
``huggingface_hub`` retries; the error says to put the file in the cache and set
``HF_HUB_OFFLINE=1``; a cached file is used. The "network" is an endpoint on a closed port,
so no test reaches the real Hub."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tokenizer_fixtures import word_level, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _prepare(
    tmp_path: Path, hf_home: Path, **env: str
) -> tuple[subprocess.CompletedProcess, float]:
    corpus = write_corpus(tmp_path / "corpus", files=2, lines=10)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
    environ.update(
        PYTHONPATH=str(ROOT),
        HF_HOME=str(hf_home),
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        **env,
    )
    argv = ["prepare", "--no-progress", "-i", str(corpus), "-o", str(tmp_path / "out")]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", *argv, "--tokenizer", "owner/tok"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started


def _cache(hf_home: Path) -> None:
    """``owner/tok``'s tokenizer.json in the Hub cache, laid out as huggingface_hub does."""
    repo = hf_home / "hub" / "models--owner--tok"
    commit = "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    word_level(repo / "snapshots" / commit / "tokenizer.json", vocab_size=300)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_an_unreachable_hub_fails_fast_with_the_offline_hint(tmp_path):
    done, seconds = _prepare(tmp_path, tmp_path / "empty-cache")
    assert done.returncode == 2, done.stderr
    assert seconds < 5.0, seconds  # was ~23 s of retries
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("error: --tokenizer") and "cannot reach the Hub" in line, line
    assert "HF_HUB_OFFLINE=1" in line and "not in the local cache" in line, line
    assert "Retrying" not in done.stderr


def test_offline_mode_without_the_file_names_the_cache(tmp_path):
    done, seconds = _prepare(tmp_path, tmp_path / "empty-cache", HF_HUB_OFFLINE="1")
    assert done.returncode == 2 and seconds < 5.0, (seconds, done.stderr)
    assert "with HF_HUB_OFFLINE=1 the file must be in the local cache" in done.stderr


def test_a_cached_tokenizer_is_used_when_the_hub_is_unreachable(tmp_path):
    _cache(tmp_path / "hf")
    done, seconds = _prepare(tmp_path, tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    assert seconds < 5.0 + 3.0, seconds  # the probe, then the work
    assert done.stdout.startswith("written "), done.stdout


def test_a_cached_tokenizer_in_offline_mode(tmp_path):
    _cache(tmp_path / "hf")
    done, _seconds = _prepare(tmp_path, tmp_path / "hf", HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
