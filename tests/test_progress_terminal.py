"""Progress bars only on a terminal (issue 29): ``prepare`` and ``train`` draw a bar when
their output is a terminal (a pseudo-terminal here) and never into a pipe or a file."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

from tokenizer_fixtures import write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], *, out_tty: bool, err_tty: bool) -> tuple[int, str, str]:
    """Run ``speedtronic argv`` with stdout and stderr on a pseudo-terminal (40 x 120) or a
    pipe each; returns (exit code, terminal text, piped text)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", *argv],
        env=env,
        stdout=child if out_tty else subprocess.PIPE,
        stderr=child if err_tty else subprocess.PIPE,
    )
    os.close(child)
    piped: list[bytes] = []
    pipe = proc.stderr if out_tty else proc.stdout
    reader = threading.Thread(target=lambda: piped.append(pipe.read()) if pipe else None)
    reader.start()
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # every holder of the terminal closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    code = proc.wait(timeout=240)
    reader.join(timeout=60)
    terminal = b"".join(chunks).decode("utf-8", "replace")
    return code, terminal, b"".join(piped).decode("utf-8", "replace")


def _prepare(tmp_path: Path, name: str) -> list[str]:
    corpus = write_corpus(tmp_path / "corpus", files=3, lines=20)
    return ["prepare", "-i", str(corpus), "-o", str(tmp_path / name), "--tokenizer", "bytes"]


def test_prepare_draws_its_bar_on_a_terminal_only(tmp_path):
    code, terminal, err = _run(_prepare(tmp_path, "piped"), out_tty=True, err_tty=False)
    assert code == 0, err
    assert "written " in terminal and "%|" not in err and "\r" not in err, err
    code, terminal, _ = _run(_prepare(tmp_path, "tty"), out_tty=True, err_tty=True)
    assert code == 0, terminal
    assert "prepare:" in terminal and "%|" in terminal, terminal  # the tqdm bar


def test_train_draws_its_bar_only_when_stdout_and_stderr_are_terminals(tmp_path):
    argv = ["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--max-steps", "5"]
    code, terminal, err = _run(
        [*argv, "--output-dir", str(tmp_path / "a")], out_tty=True, err_tty=False
    )
    assert code == 0, err
    assert "%|" not in err and "\r" not in err, err  # no bar drawn into the pipe
    assert terminal.count(" train_step ") == 5, terminal  # the step lines instead
    code, terminal, _ = _run(
        [*argv, "--output-dir", str(tmp_path / "b")], out_tty=True, err_tty=True
    )
    assert code == 0, terminal
    assert "5/5" in terminal and "%|" in terminal and " train_step " not in terminal, terminal
