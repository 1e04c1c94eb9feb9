"""docs/data.md "From a folder of text to a training run and a transformers model", run as
written (block by block, real processes) on a small corpus. Only the step count is lowered,
through the environment layer (SPEEDTRONIC_RUN__MAX_STEPS), as a user could."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizer_fixtures import write_corpus

REPO = Path(__file__).resolve().parents[1]
TITLE = "## From a folder of text to a training run and a transformers model"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def walkthrough() -> list[tuple[str, str, str]]:
    """``(language, code, file name or "")`` of every fenced block of the section, in order."""
    text = (REPO / "docs" / "data.md").read_text()
    section = text.split(TITLE, 1)[1].split("\n## ", 1)[0]
    blocks = []
    for match in BLOCK.finditer(section):
        language, code = match.group(1), match.group(2)
        name = ""
        if language == "python":
            name = re.findall(r"`([\w-]+\.py)`", section[: match.start()])[-1]
        elif language == "yaml":
            name = code.splitlines()[0].lstrip("# ").strip()
        blocks.append((language, code, name))
    return blocks


def test_the_section_has_the_steps_a_user_needs():
    blocks = walkthrough()
    commands = "\n".join(code for language, code, _ in blocks if language == "bash")
    for step in ("prepare", "validate", "train", "eval", "sample", "export"):
        assert f"speedtronic {step} " in commands
    assert [name for _, _, name in blocks if name] == [
        "train_tokenizer.py",
        "run.yaml",
        "use_model.py",
    ]


@pytest.mark.slow
def test_the_walkthrough_runs_on_a_small_corpus(tmp_path):
    pytest.importorskip("transformers")
    write_corpus(tmp_path / "my-texts", files=40, lines=40)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "SPEEDTRONIC_RUN__MAX_STEPS": "40",
        "SPEEDTRONIC_RUN__DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
    }
    outputs = []
    for language, code, name in walkthrough():
        if name:
            (tmp_path / name).write_text(code)
            continue
        assert language == "bash", language
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    _, prepared, trained, sampled, exported, used = outputs
    assert prepared.startswith("written tokens") and (tmp_path / "tokens" / "meta.json").is_file()
    assert "completed steps=40" in trained  # validate, train and eval share one block
    loss = float(re.search(r"^loss=([\d.]+) perplexity=", trained, re.M).group(1))
    assert loss < math.log(1024) - 2, trained  # it learned the corpus, far below chance
    assert sampled.startswith("The ") and len(sampled) > 10
    assert "LlamaForCausalLM" in exported
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "my-model-hf").iterdir()
    }
    assert used.startswith("The ") and len(used.strip()) > 4
