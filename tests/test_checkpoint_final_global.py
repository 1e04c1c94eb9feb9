"""The newest checkpoint of a DiLoCo node that installed the final global holds it (issue 31,
item 2), whatever ``checkpoint.every_steps`` is, in either sync mode and with an int8 global.

Before: with ``every_steps`` dividing ``max_steps`` the checkpoint written at the last step
came before the final global was installed, and the final save was skipped because that step
was already saved; ``eval``/``export``/``sample`` and a resume then used pre-final weights.
Each case runs a real master and a real worker (``python -m speedtronic train``) on a
``file://`` exchange and compares each node's newest checkpoint with the master's ``final/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from process_support import TrainProcess, child_env, tails
from safetensors.torch import load_file

from speedtronic.checkpoint import CheckpointManager
from speedtronic.cli import main

pytestmark = pytest.mark.slow


def _sets(sync: str, global_dtype: str, every: int) -> list[str]:
    return [
        "run.max_steps=10",
        "run.device=cpu",
        "eval.every_steps=0",
        "distributed.inner_steps=5",
        f"distributed.sync={sync}",
        f"distributed.global_dtype={global_dtype}",
        "distributed.min_nodes=2",
        "distributed.round_timeout=60",
        "distributed.poll_interval=0.1",
        "distributed.retry_initial=0.05",
        "distributed.retry_max=0.2",
        f"checkpoint.every_steps={every}",
        "logging.every_steps=5",
    ]


def _newest_model(run: Path) -> tuple[dict[str, torch.Tensor], Path]:
    state = CheckpointManager(run / "checkpoints", warn=lambda message: None).load_latest()
    assert state is not None, f"no checkpoint in {run}"
    return state["model"], Path(state["path"])


@pytest.mark.parametrize(
    ("sync", "global_dtype", "every"),
    [("blocking", "fp32", 5), ("overlapped", "fp32", 10), ("blocking", "int8", 5)],
)
def test_the_newest_checkpoint_of_every_node_is_the_final_global(
    tmp_path, capsys, sync, global_dtype, every
):
    repo = f"file://{tmp_path / 'exchange'}"
    sets = _sets(sync, global_dtype, every)
    env = child_env()
    master = TrainProcess(tmp_path, "m", "master", repo, sets, env).start()
    worker = TrainProcess(tmp_path, "w", "worker", repo, sets, env).start()
    assert master.wait(240, worker) == 0, tails(master, worker)
    assert worker.wait(240, master) == 0, tails(master, worker)
    final = load_file(str(master.dir / "final" / "model.safetensors"))
    for node in (master, worker):
        model, path = _newest_model(node.dir)
        assert path.name == "step_000000000010.pt", path
        for key, value in final.items():
            assert torch.equal(model[key], value), f"{node.name}: {key} is not the final global"
    # eval on the worker's newest checkpoint and on final/ score the same weights
    losses = []
    for source in (worker.dir / "checkpoints", master.dir / "final"):
        assert main(["eval", "--checkpoint", str(source), "--format", "json"]) == 0
        losses.append(capsys.readouterr().out)
    import json

    first, second = (json.loads(text) for text in losses)
    assert first["loss"] == second["loss"], (first, second)
