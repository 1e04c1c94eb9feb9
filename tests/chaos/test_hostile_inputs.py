"""Chaos: hostile files and environments that arrive with a run (issue 39), swept through the
command line as a user would meet them. Every refusal is exit code 2 with one ``error:`` line
naming the field or file, never a traceback, and nothing is created outside the places the
run owns; the environments a run cannot refuse (an odd thread count, a planted registry entry)
leave it training. Prints a table of attack -> outcome.

The model-folder and dataset attacks run in this process (each is refused before any work);
the thread-registry attacks start real ``speedtronic train`` processes (a FIFO blocks a real
``open``, and a hang must end in a timeout, not a stuck suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.cli import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
RESULTS: list[tuple[str, str]] = []


def _model_folder(root: Path, index: object = None, **config: object) -> Path:
    """A transformers-shaped folder: config.json and, with ``index``, a shard index that names
    the weight file ``index``."""
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**SHAPE, **config}))
    if index is not None:
        document = {"metadata": {}, "weight_map": {"model.norm.weight": index}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(document))
    return folder


def _parquet(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [b"fine text", b"bad \xff bytes", b"more text"]
    column = pa.array(rows, type=pa.binary()).view(pa.string())  # not checked by the writer
    pq.write_table(pa.table({"text": column}), root / "rows.parquet")
    return root / "rows.parquet"


# name, setup(root, victim) -> argv, what the one error line must say
ATTACKS: list[tuple[str, Callable[[Path, Path], list[str]], str]] = [
    (
        "init_from index names ../outside",
        lambda root, victim: ["--init-from", str(_model_folder(root, "../victim/x.safetensors"))],
        "which is not a relative path inside the model folder",
    ),
    (
        "init_from index names an absolute path",
        lambda root, victim: ["--init-from", str(_model_folder(root, str(victim / "x")))],
        "which is not a relative path inside the model folder",
    ),
    (
        "rope_scaling beside rope_parameters",
        lambda root, victim: [
            "--init-from",
            str(_model_folder(root, rope_scaling={"rope_type": "yarn", "factor": 4.0})),
        ],
        "LlamaForCausalLM with rope_scaling = ",
    ),
    (
        "a bare --init-from name (no folder, no owner)",
        lambda root, victim: ["--init-from", "my-export"],
        "no local folder 'my-export'",
    ),
]
PREPARE_ATTACKS: list[tuple[str, Callable[[Path, Path], list[str]], str]] = [
    (
        "hf://datasets/o/n//<absolute path>",
        lambda root, victim: ["-i", f"hf://datasets/org/corpus/{victim}"],
        "an empty ('//'), '.', backslash or NUL segment is not allowed",
    ),
    (
        "Parquet column with invalid UTF-8, --utf8 strict",
        lambda root, victim: ["-i", str(_parquet(root)), "--utf8", "strict"],
        "rows.parquet: row 2, column 'text': invalid UTF-8",
    ),
]


def _victim(tmp_path: Path) -> Path:
    """A folder that must stay as it is: files only a hostile input could point at."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("private notes that are no training data\n")
    return victim


@pytest.mark.parametrize(("name", "setup", "expected"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_a_hostile_model_folder_is_one_line_exit_2(tmp_path, capsys, name, setup, expected):
    victim = _victim(tmp_path)
    run = tmp_path / "run.yaml"
    run.write_text(f"run: {{output_dir: {tmp_path / 'out'}, device: cpu}}\n")
    started = time.monotonic()
    code = main(["validate", "--config", str(run), *setup(tmp_path, victim)])
    err = capsys.readouterr().err.strip()
    seconds = time.monotonic() - started
    RESULTS.append((name, f"exit {code} in {seconds:.1f} s: ...{err[-60:]}"))
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: model.init_from")
    assert expected in err and "Traceback" not in err
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"]
    assert seconds < 10  # no Hub round trips


@pytest.mark.parametrize(
    ("name", "setup", "expected"), PREPARE_ATTACKS, ids=[a[0] for a in PREPARE_ATTACKS]
)
def test_a_hostile_dataset_is_one_line_exit_2(tmp_path, capsys, name, setup, expected):
    victim = _victim(tmp_path)
    out = tmp_path / "tokens"
    code = main(["prepare", "--no-progress", "-o", str(out), *setup(tmp_path, victim)])
    err = capsys.readouterr().err.strip()
    RESULTS.append((name, f"exit {code}: ...{err[-60:]}"))
    assert code == 2 and len(err.splitlines()) == 1 and expected in err
    assert not (out / "meta.json").exists()
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"]


def _train(tmp_path: Path, name: str, **env: str) -> subprocess.CompletedProcess:
    """``speedtronic train`` of the smoke config for 2 steps; a hang is a timeout (30 s over
    its usual time), not a stuck suite."""
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    environ.update(PYTHONPATH=str(ROOT), **env)
    command = [sys.executable, "-m", "speedtronic", "train", "--config", "configs/smoke.yaml"]
    command += ["--output-dir", str(tmp_path / name), "--max-steps", "2"]
    command += ["--set", "checkpoint.enabled=false", "--set", "eval.holdout=0"]
    return subprocess.run(
        command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=90
    )


def test_planted_registry_entries_and_odd_thread_counts_never_stop_a_run(tmp_path) -> None:
    """A FIFO named like a registry entry (its open used to wait for a writer for good), a
    registry folder that is a link to somebody else's folder, ``OMP_NUM_THREADS=²`` (a digit
    to ``str.isdigit``, a ValueError to ``int``) and ``LOCAL_WORLD_SIZE=5000``."""
    planted = tmp_path / "run-fifo" / "speedtronic" / "threads"
    planted.mkdir(parents=True, mode=0o700)
    (tmp_path / "run-fifo").chmod(0o700)
    os.mkfifo(planted / "4242-planted.lock")
    done = _train(
        tmp_path,
        "fifo",
        XDG_RUNTIME_DIR=str(tmp_path / "run-fifo"),
        OMP_NUM_THREADS="²",
        LOCAL_WORLD_SIZE="5000",
    )
    said = done.stdout + done.stderr
    RESULTS.append(
        ("FIFO *.lock + OMP_NUM_THREADS=² + LOCAL_WORLD_SIZE=5000", f"exit {done.returncode}")
    )
    assert done.returncode == 0, said[-3000:]
    assert "OMP_NUM_THREADS='²' in the environment is not a positive integer; ignored" in said
    assert "LOCAL_WORLD_SIZE=5000 is more than the" in said and "Traceback" not in said

    victim = _victim(tmp_path)
    (tmp_path / "run-link").mkdir(mode=0o700)
    (tmp_path / "run-link" / "speedtronic").symlink_to(victim)
    done = _train(tmp_path, "link", XDG_RUNTIME_DIR=str(tmp_path / "run-link"))
    RESULTS.append(("registry folder is a link", f"exit {done.returncode}"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"]  # nothing made in it


def test_print_the_table() -> None:
    """The sweep's table (run last in this file; -s shows it)."""
    width = max((len(name) for name, _ in RESULTS), default=10)
    print("\nhostile inputs (issue 39):")
    for name, outcome in RESULTS:
        print(f"  {name:<{width}}  {outcome}")
