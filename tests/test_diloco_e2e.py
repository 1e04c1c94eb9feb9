# ruff: noqa: F811  (pytest fixtures imported from tests.hub_emulator_fixtures)
"""End-to-end DumbDiLoCo with real ``python -m speedtronic train`` processes.

- Three nodes (a master that trains + two workers) over a shared directory compute exactly the
  in-process DiLoCo arithmetic (:func:`speedtronic.testing.diloco_ideal.simulate`), and their global
  reaches a lower held-out loss than one node at equal steps per node.
- The same over the Hub emulator (the transport changes nothing in the arithmetic).
- Membership and failures: a worker that joins late, one SIGKILLed and resumed, the master
  SIGKILLed and resumed mid-run: no contribution is counted twice or silently lost.
- Injected Hub faults (5xx, dropped connections): every node finishes, nothing counted twice.

Nothing here depends on wall-clock pacing: the golden runs set ``min_nodes`` so the first
round waits for every node, and the failure runs assert invariants, not round counts.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, hub_emulator  # noqa: F401
from process_support import TrainProcess, child_env, wait_for

from speedtronic.checkpoint import CheckpointManager
from speedtronic.config import resolve_config
from speedtronic.diloco.codec import cpu_state_dict, load_safetensors
from speedtronic.diloco.exchange import syncs_momentum
from speedtronic.model import build_model
from speedtronic.testing.diloco_ideal import simulate
from speedtronic.train.evaluate import build_heldout, evaluate
from speedtronic.train.runtime import build_runtime

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~640k byte tokens of Python source (three stdlib packages), as a uint16 token file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for pkg in ("email", "json", "http") for p in sorted((root / pkg).rglob("*.py"))]
    data = np.concatenate([np.frombuffer(p.read_bytes(), np.uint8) for p in files])
    path = tmp_path_factory.mktemp("corpus") / "python.bin"
    data[data < 128].astype(np.uint16).tofile(path)
    return path


def overrides(corpus: Path, steps: int, inner: int) -> list[str]:
    """The test model/data on top of configs/diloco.yaml (its distributed settings kept)."""
    return [
        f"run.max_steps={steps}",
        "run.seed=1",
        "run.device=cpu",
        "model.vocab_size=128",
        "model.max_seq_len=32",
        "model.n_layer=2",
        "model.n_head=4",
        "model.n_kv_head=4",
        "model.d_model=64",
        "data.synthetic=none",
        f"data.token_path={corpus}",
        "data.micro_batch_size=8",
        "data.target_batch_size=8",
        "eval.holdout=0.05",
        "eval.tokens=8192",
        "eval.every_steps=0",
        "optimizer.lr=3e-3",
        "optimizer.weight_decay=0.1",
        "scheduler.warmup_steps=10",
        f"distributed.inner_steps={inner}",
        "distributed.poll_interval=0.1",
        "distributed.retry_initial=0.05",
        "distributed.retry_max=0.2",
        "distributed.retry_attempts=8",
        "distributed.request_timeout=5",
    ]


def Node(tmp: Path, name: str, role: str, repo: str, sets: list[str], env: dict) -> TrainProcess:
    """One ``speedtronic train`` process of these tests (its own Hub cache, a checkpoint every
    5 steps)."""
    extra = (
        f"distributed.cache_dir={tmp / 'hubcache' / name}",
        "logging.every_steps=10",
        "checkpoint.every_steps=5",
    )
    return TrainProcess(tmp, name, role, repo, sets, env, extra)


def _three_nodes(tmp: Path, repo: str, sets: list[str], env: dict) -> list[TrainProcess]:
    """Master ``m`` and workers ``w1``, ``w2`` started at once, each run to exit 0 (300 s)."""
    names = (("m", "master"), ("w1", "worker"), ("w2", "worker"))
    nodes = [Node(tmp, name, role, repo, sets, env).start() for name, role in names]
    for node in nodes:
        assert node.wait(300) == 0, node.tail()
    return nodes


def _env(**extra: str) -> dict[str, str]:
    """A node's environment: the emulator's token, no telemetry, then ``extra``."""
    return child_env(HF_TOKEN=TEST_TOKEN, HF_HUB_DISABLE_TELEMETRY="1", **extra)


def _assert_no_token(tmp: Path) -> None:
    needle = TEST_TOKEN.encode()
    for path in tmp.rglob("*"):
        if path.is_file():
            assert needle not in path.read_bytes(), f"token leaked into {path}"


def _config(corpus: Path, sets: list[str]):
    return resolve_config(
        ROOT / "configs/diloco.yaml", environ={}, secrets_dir="/nonexistent", overrides=sets
    ).config


def _heldout_loss(config, state: dict) -> float:
    model = build_model(config.model)
    model.load_state_dict(state, strict=False)
    return evaluate(model, build_heldout(config), device=torch.device("cpu")).loss


def _run_golden(
    tmp: Path, corpus: Path, repo: str, env: dict, steps: int, inner: int, extra: tuple = ()
):
    """Master (trains) + w1 + w2, all started at once; the first round waits for all three."""
    sets = [*overrides(corpus, steps, inner), "distributed.min_nodes=3", *extra]
    return _three_nodes(tmp, repo, sets, env), sets


def _check_golden(tmp: Path, corpus: Path, nodes: list[TrainProcess], sets: list[str], rounds: int):
    master = nodes[0]
    events = master.events("outer_step")
    assert [row["outer_step"] for row in events] == list(range(1, rounds + 1))
    for r, row in enumerate(events):  # one contribution per node per round, every round
        assert row["included"] == [f"m/{r}", f"w1/{r}", f"w2/{r}"], row
        assert row["reason"] == "complete" and row["deltas_late"] == 0
    for node in nodes:  # each contribution reports where its round's time went
        done = node.events("round_done")
        assert [row["round"] for row in done] == list(range(rounds)), node.name
        for row in done:
            assert row["compute_seconds"] > 0 and row["wait_seconds"] >= 0, (node.name, row)
            total = row["compute_seconds"] + row["wait_seconds"]
            assert row["utilization"] == pytest.approx(row["compute_seconds"] / total)
    final = load_safetensors(master.dir / "final" / "model.safetensors")
    assert json.loads((master.dir / "final" / "meta.json").read_text())["outer_step"] == rounds
    # the protocol computed exactly the in-process arithmetic
    torch.set_num_threads(1)
    config = _config(corpus, sets)
    ideal = simulate(config, ["m", "w1", "w2"])
    assert ideal.outer_steps == rounds
    for key, value in ideal.global_state.items():
        assert torch.allclose(final[key].float(), value.float(), atol=1e-6), key
    # every node's final checkpoint holds the final global
    for node in nodes:
        state = CheckpointManager(node.dir / "checkpoints").load_latest()
        for key, value in final.items():
            assert torch.equal(state["model"][key], value), (node.name, key)
    return config, final


def test_three_nodes_compute_the_ideal_arithmetic_and_beat_one_node(tmp_path, corpus):
    steps, inner = 150, 10
    nodes, sets = _run_golden(
        tmp_path, corpus, f"file://{tmp_path / 'exchange'}", _env(), steps, inner
    )
    config, final = _check_golden(tmp_path, corpus, nodes, sets, steps // inner)
    # quality: the 3-node global beats one node trained on the same steps per node
    single_config = _config(
        corpus, [*sets, "distributed.enabled=false", f"run.output_dir={tmp_path / 'single'}"]
    )
    trainer, _ = build_runtime(single_config)
    trainer.heldout = None
    trainer.fit()
    trainer.logger.close()
    single = _heldout_loss(single_config, cpu_state_dict(trainer.model.state_dict()))
    global_loss = _heldout_loss(config, final)
    assert global_loss < single - 0.02, (global_loss, single)
    # the master scored every new global; the last score is the final global's (the default
    # final_average 2: the mean of the last two, a model no round scored, scored at the end)
    scores = nodes[0].events("eval")
    global_scores = [row for row in scores if row["scope"] == "global"]
    assert sorted({row["outer_step"] for row in global_scores}) == list(
        range(1, steps // inner + 1)
    )
    assert [row["final"] for row in global_scores].count(True) == 1
    assert global_scores[-1]["final"] and global_scores[-1]["outer_step"] == steps // inner
    assert global_scores[-1]["loss"] == pytest.approx(global_loss, abs=1e-4)
    assert global_scores[-1]["loss"] < global_scores[0]["loss"] - 0.5
    step_count = json.loads((tmp_path / "exchange/global/step_count.json").read_text())
    assert step_count["final"] is True and step_count["outer_step"] == steps // inner
    _assert_no_token(tmp_path)


def test_three_nodes_with_int8_deltas_compute_the_quantized_ideal_arithmetic(tmp_path, corpus):
    """int8 deltas with error feedback through the directory store: every round closes with
    all three nodes, the final global is the ideal arithmetic with the same quantizer and
    residuals, and each upload is about a quarter of the fp32 values' bytes."""
    steps, inner = 60, 10
    repo = f"file://{tmp_path / 'exchange'}"
    extra = ("distributed.delta_dtype=int8",)
    nodes, sets = _run_golden(tmp_path, corpus, repo, _env(), steps, inner, extra)
    config, final = _check_golden(tmp_path, corpus, nodes, sets, steps // inner)
    assert config.distributed.delta_dtype == "int8"
    fp32 = 4 * sum(value.numel() for value in final.values() if value.is_floating_point())
    for node in nodes:
        uploads = node.events("delta_uploaded")
        assert len(uploads) == steps // inner
        assert all(row["bytes"] < 0.3 * fp32 for row in uploads), uploads


def test_three_nodes_with_adaptive_outer_steps_and_a_final_average_equal_the_ideal(
    tmp_path, corpus
):
    """``outer_step: adaptive`` and ``final_average: 2`` in real processes: every round's eta
    (the master's ``outer_step`` events) is the ideal's, some round extrapolates (eta > 1),
    and the final global, ``final/`` and every node's last checkpoint are the ideal's mean of
    the last two globals."""
    steps, inner = 60, 10
    repo = f"file://{tmp_path / 'exchange'}"
    extra = (
        "distributed.outer_step=adaptive",
        "distributed.adaptive_c=1.5",  # three nodes' short rounds agree: c 0.75 keeps eta 1.0
        "distributed.final_average=2",
    )
    nodes, sets = _run_golden(tmp_path, corpus, repo, _env(), steps, inner, extra)
    config, _ = _check_golden(tmp_path, corpus, nodes, sets, steps // inner)
    ideal = simulate(config, ["m", "w1", "w2"])
    etas = [row["eta"] for row in nodes[0].events("outer_step")]
    assert etas == ideal.etas, (etas, ideal.etas)
    assert 1.0 < max(etas) < 2.0, etas  # some rounds extrapolate, none at the cap
    record = json.loads((tmp_path / "exchange/global/step_count.json").read_text())
    assert float(record["eta"]) == etas[-1]


@pytest.mark.parametrize(
    "extra",
    [
        ("distributed.sync=overlapped", "distributed.overlap_steps=3"),
        (
            "distributed.sync=overlapped",
            "distributed.overlap_steps=8",
            "distributed.fragments=2",
            "distributed.delta_dtype=int8",
            "distributed.global_dtype=int8",
        ),
        ("distributed.sync=overlapped", "distributed.overlap_steps=3", "distributed.fragments=2"),
    ],
    ids=["overlapped", "two-rounds-in-flight-fragments-int8", "fragments-fp32"],
)
def test_overlapped_nodes_merge_each_global_at_its_step_and_equal_the_ideal(
    tmp_path, corpus, extra
):
    """``sync: overlapped``: a node keeps training after its upload and merges the round's
    global exactly ``overlap_steps`` later (held until then, awaited then), so three
    processes compute the ideal arithmetic of the same schedule, bit for bit, whatever the
    timing. With ``fragments: 2`` each round syncs half of the tensors (rounds of 5 steps,
    one more round at the end syncs every tensor), the int8 global travels as the
    fragment's outer update, and ``overlap_steps`` 8 keeps two rounds in flight: each
    fragment's tensors are merged 8 steps after their upload, from whichever global is
    newest by then. With an fp32 global, a fragment's round travels as the new values of
    its tensors (exact), applied by each worker to the global it holds."""
    steps, inner = 60, 10
    repo = f"file://{tmp_path / 'exchange'}"
    nodes, sets = _run_golden(tmp_path, corpus, repo, _env(), steps, inner, extra)
    config = _config(corpus, sets)
    rounds = simulate(config, ["m", "w1", "w2"]).outer_steps
    _, final = _check_golden(tmp_path, corpus, nodes, sets, rounds)
    blocking = simulate(config, ["m", "w1", "w2"], sync="blocking")
    assert rounds == blocking.outer_steps  # the same rounds, merged later: other numbers
    assert any(not torch.equal(final[k], v) for k, v in blocking.global_state.items())
    for node in nodes[1:]:  # a worker merges each round's global once, as an update or whole
        rows = node.events("global_pulled")
        pulled = [row["outer_step"] for row in rows if not row["final"]]
        assert pulled == sorted(set(pulled)), pulled
        # and the final global (final_average 2: the mean of the last two) once, last; it comes
        # under the last global's outer step when that global was published before every node
        # was done, so the last step may appear twice: once as the round's, once as the final
        assert [row["final"] for row in rows].count(True) == 1 and rows[-1]["final"], rows
        if "distributed.fragments=2" in extra:  # each round's global: its fragment's update
            sources = {row["source"] for row in rows[1:] if not row["final"]}
            assert sources == {"update"}, rows


def test_fragments_in_a_run_that_ends_between_rounds_equal_the_ideal(tmp_path, corpus):
    """``fragments: 2`` and a last step that is not a round boundary (58 steps, rounds of 5):
    the run ends with a round of each fragment, each carrying its progress since its last
    round (the fragment synced at step 55 has trained 3 more steps, the other 8), and the
    ideal counts them too (before the rounds that end a run were one round of every tensor,
    it left that fragment's last 3 steps out)."""
    steps, inner = 58, 10
    repo = f"file://{tmp_path / 'exchange'}"
    extra = ("distributed.sync=overlapped", "distributed.overlap_steps=3")
    extra = (*extra, "distributed.fragments=2")
    nodes, sets = _run_golden(tmp_path, corpus, repo, _env(), steps, inner, extra)
    rounds = simulate(_config(corpus, sets), ["m", "w1", "w2"]).outer_steps
    assert rounds == 13  # 11 rounds at steps 5 .. 55, then one of each fragment at 58
    _check_golden(tmp_path, corpus, nodes, sets, rounds)


@pytest.mark.parametrize(
    ("wire", "every"), [("fp32", 1), ("int8", 1), ("fp32", 2)], ids=["fp32", "int8", "every-2nd"]
)
def test_three_nodes_averaging_their_first_moments_equal_the_ideal(tmp_path, corpus, wire, every):
    """``sync_inner_momentum: every_round`` (or ``every_n`` with ``inner_momentum_every: 2``):
    each node sends its AdamW first moment with its delta in the syncing rounds, the master
    publishes their mean with the global and every node installs it; the final global is the
    ideal's (which would differ without the averaged moments), and a round's global costs a
    worker the moments' file only when it carries them."""
    steps, inner = 60, 10
    repo = f"file://{tmp_path / 'exchange'}"
    mode = "every_round" if every == 1 else "every_n"
    extra = (
        f"distributed.sync_inner_momentum={mode}",
        f"distributed.inner_momentum_every={every}",
        f"distributed.delta_dtype={wire}",
    )
    nodes, sets = _run_golden(tmp_path, corpus, repo, _env(), steps, inner, extra)
    config, final = _check_golden(tmp_path, corpus, nodes, sets, steps // inner)
    assert simulate(config, ["m", "w1", "w2"]).momentum_syncs == steps // inner // every
    off = simulate(
        _config(corpus, [*sets, "distributed.sync_inner_momentum=off"]), ["m", "w1", "w2"]
    )
    assert max((off.global_state[k] - final[k]).abs().max().item() for k in final) > 1e-4
    moments = (tmp_path / "exchange/global/moments.safetensors").stat().st_size
    weights = sum(value.numel() * value.element_size() for value in final.values())
    rounds = range(1, steps // inner)  # the last global is the final one
    expected = [weights + (moments if syncs_momentum(mode, every, r) else 0) for r in rounds]
    for node in nodes[1:]:
        pulled = {row["outer_step"]: row["bytes"] for row in node.events("global_pulled")}
        assert [pulled[r] for r in rounds] == expected, node.name


def test_three_nodes_with_an_int8_global_apply_each_update_bit_for_bit(tmp_path, corpus):
    """int8 deltas and the global as an int8 outer update: every worker takes each round's
    global by applying the update to the last one (its digest proves the result is the
    master's global bit for bit), and the final global is the ideal arithmetic with the
    master's quantizer and residual."""
    steps, inner = 60, 10
    repo = f"file://{tmp_path / 'exchange'}"
    extra = ("distributed.delta_dtype=int8", "distributed.global_dtype=int8")
    nodes, sets = _run_golden(tmp_path, corpus, repo, _env(), steps, inner, extra)
    config, final = _check_golden(tmp_path, corpus, nodes, sets, steps // inner)
    assert config.distributed.global_dtype == "int8"
    fp32 = 4 * sum(value.numel() for value in final.values() if value.is_floating_point())
    rounds = steps // inner
    for node in nodes[1:]:
        pulled = node.events("global_pulled")
        updates = [row for row in pulled if row["source"] == "update"]
        assert [row["outer_step"] for row in updates] == list(range(1, rounds + 1)), node.name
        assert all(row["bytes"] < 0.3 * fp32 for row in updates), (node.name, updates)
        # none whole (issue 38): the first global is the worker's own starting weights
        # (built alike: the weights file's sha256), and with the default final_average 2 the
        # final model (the mean of the last two globals) is made from the two it holds
        sources = {row["source"]: row["outer_step"] for row in pulled if row["source"] != "update"}
        assert sources == {"own": 0, "mean": rounds}, (node.name, pulled)
        assert all(row["bytes"] == 0 for row in pulled if row["source"] != "update")
        assert not node.events("global_update_refused")


def test_three_nodes_over_the_hub_emulator(tmp_path, corpus, hub_emulator):
    env = _env(HF_ENDPOINT=hub_emulator.url)
    steps, inner = 40, 10
    nodes, sets = _run_golden(tmp_path, corpus, "org/diloco-e2e", env, steps, inner)
    _check_golden(tmp_path, corpus, nodes, sets, steps // inner)
    files = hub_emulator.files("org/diloco-e2e")
    assert json.loads(files["global/step_count.json"])["final"] is True
    assert not [p for p in files if p.endswith(".safetensors") and p.startswith("nodes/")]
    assert hub_emulator.repos["org/diloco-e2e"].private
    _assert_no_token(tmp_path)


def _uploaded(node: TrainProcess) -> set[tuple[str, int]]:
    return {(node.name, row["round"]) for row in node.events("delta_uploaded")}


def _dropped(master: TrainProcess) -> set[tuple[str, int]]:
    out = set()
    for row in master.events("outer_step"):
        for item in row["dropped"]:
            node, label = item.split("/")
            out.add((node, int(label)))
    return out


def test_late_join_kill_and_resume_of_a_worker_and_of_the_master(tmp_path, corpus):
    repo = f"file://{tmp_path / 'exchange'}"
    sets = [
        *overrides(corpus, 120, 5),
        "distributed.round_timeout=3",
        "distributed.drop_after=2",
    ]
    env = _env()
    master = Node(tmp_path, "m", "master", repo, [*sets, "run.max_steps=160"], env).start()
    w1 = Node(tmp_path, "w1", "worker", repo, sets, env).start()
    wait_for(lambda: len(master.events("outer_step")) >= 2, 180, "two rounds")
    w2 = Node(tmp_path, "w2", "worker", repo, [*sets, "run.max_steps=60"], env).start()
    wait_for(lambda: len(w1.events("delta_uploaded")) >= 6, 180, "six w1 uploads")
    assert w1.proc.poll() is None, "w1 finished before it could be killed"
    w1.kill()
    w1.start(resume=True)
    wait_for(lambda: len(master.events("outer_step")) >= 12, 240, "twelve rounds")
    assert master.proc.poll() is None, "the master finished before it could be killed"
    master.kill()
    master.start(resume=True)
    for node in (w1, w2, master):
        assert node.wait(300) == 0, node.tail()

    included = master.included()
    assert len(included) == len(set(included)), "a contribution was aggregated twice"
    rounds = master.events("outer_step")
    for row in rounds:  # at most one contribution per node and round label
        labels = [tuple(item.split("/")) for item in row["included"]]
        assert len(labels) == len(set(labels))
    dropped = _dropped(master)
    for node in (master, w1, w2):  # every upload was aggregated or counted as dropped
        missing = _uploaded(node) - set(included) - dropped
        assert not missing, (node.name, sorted(missing))
    w2_labels = sorted(label for node, label in included if node == "w2")
    assert w2_labels and w2_labels[0] >= 2  # joined late: from the round it found
    ledger = json.loads((tmp_path / "exchange/global/processed.json").read_text())["nodes"]
    for node in (master, w1, w2):  # every node's last contribution is in the final global
        assert ledger[node.name] == max(label for _, label in _uploaded(node))
    assert (master.dir / "final" / "model.safetensors").exists()
    assert json.loads((tmp_path / "exchange/global/step_count.json").read_text())["final"]


def test_injected_hub_faults_every_node_finishes_nothing_counted_twice(
    tmp_path, corpus, hub_emulator
):
    hub_emulator.set_faults(error_rate=0.2, drop_rate=0.1, seed=7)
    env = _env(HF_ENDPOINT=hub_emulator.url)
    repo = "org/diloco-faults"
    sets = [*overrides(corpus, 60, 5), "distributed.round_timeout=5"]
    nodes = _three_nodes(tmp_path, repo, sets, env)
    master = nodes[0]
    included = master.included()
    assert len(included) == len(set(included))
    dropped = _dropped(master)
    ledger = json.loads(hub_emulator.files(repo)["global/processed.json"])["nodes"]
    for node in nodes:
        assert not _uploaded(node) - set(included) - dropped, node.name
        assert ledger[node.name] == max(label for _, label in _uploaded(node))
        # a failed upload is carried: the node's contributions after it were aggregated (the
        # carry goes out under the failed round's label when the master has not moved on: a
        # label is used up only by an upload that arrived, so any label >= it came after)
        for row in node.events("delta_upload_failed"):
            assert any(n == node.name and label >= row["round"] for n, label in included)
    counts = hub_emulator.stats()["counts"]
    assert counts.get("fault:error", 0) > 0 and counts.get("fault:drop", 0) > 0
    assert any(node.events("transport_retry") for node in nodes)
    assert json.loads(hub_emulator.files(repo)["global/step_count.json"])["final"] is True
    _assert_no_token(tmp_path)
