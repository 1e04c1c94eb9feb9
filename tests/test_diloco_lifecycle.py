"""The edges of a DiLoCo run's life, reproduced with real ``python -m speedtronic train``
processes on a ``file://`` exchange (issue 20):

- a master restarted at or past its last step keeps serving rounds, then publishes the final
  global;
- a new run over an exchange that holds a finished run: no node trains from the old weights,
  every round of the new run holds every node;
- a node that arrives after the final global says so in one line and exits 0;
- the same node id on two hosts: the later node exits 2, the earlier one's rounds count.

Each process is tiny (a 2-layer model on the synthetic Markov chain); every wait has a deadline
well inside the test's own timeout and prints the processes' output when it gives up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from process_support import TrainProcess, child_env, tails, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _sets(steps: int, inner: int = 5) -> list[str]:
    return [
        f"run.max_steps={steps}",
        "run.device=cpu",
        "eval.every_steps=0",
        f"distributed.inner_steps={inner}",
        "distributed.poll_interval=0.1",
        "distributed.retry_initial=0.05",
        "distributed.retry_max=0.2",
        "distributed.request_timeout=5",
        "checkpoint.every_steps=5",
        "logging.every_steps=5",
    ]


def Proc(tmp: Path, name: str, role: str, sets: list[str], env: dict | None = None):
    """One ``speedtronic train`` process on the shared-directory exchange ``tmp/exchange``."""
    repo = f"file://{tmp / 'exchange'}"
    return TrainProcess(tmp, name, role, repo, sets, env or child_env())


def _wait(predicate, timeout: float, what: str, *procs: TrainProcess) -> None:
    try:
        wait_for(predicate, timeout, what, interval=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{tails(*procs)}") from None


def _step_count(tmp: Path) -> dict:
    return json.loads((tmp / "exchange/global/step_count.json").read_text())


def _ledger(tmp: Path) -> dict:
    return json.loads((tmp / "exchange/global/processed.json").read_text())["nodes"]


def _uploaded(node: TrainProcess, name: str | None = None) -> set[tuple[str, int]]:
    return {(name or node.name, row["round"]) for row in node.events("delta_uploaded")}


def test_a_master_restarted_after_its_last_step_serves_the_remaining_rounds(tmp_path):
    """Killed while it waits for a slower worker, the master resumes at its last step: it
    serves every remaining round of the worker, then publishes the final global."""
    master = Proc(tmp_path, "m", "master", [*_sets(10), "distributed.min_nodes=2"])
    slow = ["data.micro_batch_size=2", "data.target_batch_size=48"]  # 24 micro-batches a step
    worker = Proc(tmp_path, "w", "worker", [*_sets(30), *slow, "distributed.round_timeout=20"])
    master.start()
    worker.start()
    at_end = lambda: any(row["step"] == 10 for row in master.events("checkpoint_saved"))  # noqa: E731
    _wait(at_end, 120, "the master's checkpoint at its last step", master, worker)
    assert worker.proc.poll() is None, "the worker finished before the master was killed"
    master.kill()
    master.start(resume=True)
    assert master.wait(180, worker) == 0, tails(master, worker)
    assert worker.wait(180, master) == 0, tails(master, worker)
    assert _step_count(tmp_path).get("final") is True
    included = master.included()
    assert len(included) == len(set(included)), "a contribution was aggregated twice"
    assert not _uploaded(worker) - set(included), tails(master, worker)
    assert _ledger(tmp_path)["w"] == max(label for _, label in _uploaded(worker))
    assert (master.dir / "final" / "model.safetensors").exists()


def _global_pulls(node: TrainProcess) -> list[tuple[int, int]]:
    return [(row["outer_step"], row["step"]) for row in node.events("global_pulled")]


def _finished_run(tmp: Path, sets: list[str]) -> tuple[int, list[TrainProcess]]:
    """Master ``m`` and worker ``w`` run to the end; returns the final outer step."""
    old = [Proc(tmp, "m_old", "master", sets), Proc(tmp, "w_old", "worker", sets)]
    for proc, node_id in zip(old, ("m", "w"), strict=True):
        proc.start(node_id=node_id)
    for proc in old:
        assert proc.wait(180, *old) == 0, tails(*old)
    assert _step_count(tmp).get("final") is True
    return _step_count(tmp)["outer_step"], old


def test_a_new_run_over_a_finished_one_never_trains_from_its_weights(tmp_path):
    """The exchange holds a finished run; a new run's worker starts before its master. The
    worker waits for the new run instead of taking the old final global, and every round of
    the new run holds both nodes."""
    sets = [*_sets(10), "distributed.min_nodes=2", "distributed.round_timeout=60"]
    finished = _finished_run(tmp_path, sets)[0]

    worker = Proc(tmp_path, "w_new", "worker", sets).start(node_id="w")
    master = Proc(tmp_path, "m_new", "master", sets)
    waiting = lambda: "first global of a new run" in worker.tail()  # noqa: E731
    _wait(lambda: waiting() or _global_pulls(worker), 120, "the new worker's start", worker)
    master.start(node_id="m")
    assert master.wait(180, worker) == 0, tails(master, worker)
    assert worker.wait(180, master) == 0, tails(master, worker)
    pulls = _global_pulls(worker)
    assert pulls and pulls[0] == (0, 0), (pulls, finished, tails(worker))
    rounds = master.events("outer_step")
    assert [row["outer_step"] for row in rounds] == [1, 2]
    for r, row in enumerate(rounds):  # both nodes in every round of the new run
        assert row["included"] == [f"m/{r}", f"w/{r}"], row
    assert _step_count(tmp_path).get("final") is True


def test_nodes_that_arrive_after_the_final_global_exit_0_with_one_line(tmp_path):
    """A worker resumed into the finished run stops at once; a fresh worker waits (bounded by
    round_timeout) for a new run, then stops. Neither uploads anything."""
    sets = [*_sets(10), "distributed.min_nodes=2", "distributed.round_timeout=3"]
    _, (_, old_worker) = _finished_run(tmp_path, sets)
    uploads_before = len(old_worker.events("delta_uploaded"))
    late = Proc(tmp_path, "late", "worker", [*sets, "run.max_steps=20"]).start()
    old_worker.start(resume=True, node_id="w")
    assert old_worker.wait(120, late) == 0, tails(old_worker)
    assert late.wait(120, old_worker) == 0, tails(late)
    assert "this node's run already ended" in old_worker.tail(), tails(old_worker)
    assert "no new run started within" in late.tail(), tails(late)
    assert len(old_worker.events("delta_uploaded")) == uploads_before
    assert not late.events("delta_uploaded") and not late.events("global_pulled")
    assert not (tmp_path / "exchange/nodes/late").exists()  # it never claimed an id


def test_the_same_node_id_on_a_second_host_exits_2_and_the_first_goes_on(tmp_path):
    """Worker ``w`` runs on host-a; a second ``w`` starts on host-b (another HOSTNAME, its own
    state): it watches the id's files, sees the first node write, and exits 2 with one line
    before writing anything. The first node's rounds are all aggregated."""
    slow = ["data.micro_batch_size=2", "data.target_batch_size=32", "distributed.min_nodes=2"]
    sets = [*_sets(60), *slow, "distributed.round_timeout=30"]
    master = Proc(tmp_path, "m", "master", sets).start()
    first = Proc(tmp_path, "w_a", "worker", sets, child_env(HOSTNAME="host-a"))
    second = Proc(tmp_path, "w_b", "worker", sets, child_env(HOSTNAME="host-b"))
    first.start(node_id="w")
    _wait(lambda: first.events("delta_uploaded"), 120, "the first w's upload", master, first)
    second.start(node_id="w")
    assert second.wait(120, first, master) == 2, tails(second)
    errors = [line for line in second.tail().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "distributed.node_id" in errors[0], tails(second)
    assert "host-a" in errors[0], errors
    assert not second.events("delta_uploaded")
    assert first.proc.poll() is None, "the first node ended before the second one was refused"
    assert first.wait(180, master) == 0, tails(first, master)
    assert master.wait(180, first) == 0, tails(first, master)
    included = master.included()
    assert not _uploaded(first, "w") - set(included), tails(master, first)
    assert _step_count(tmp_path).get("final") is True


def test_hub_access_refused_exits_2_naming_the_repo_and_the_token_source(tmp_path):
    """A token the Hub does not know (404 for the repository), a refused one (401) and a
    read-only one (403 on the first write): each node exits 2 with one line that names the
    repository and where its token came from, never the token."""
    from hub_emulator_fixtures import TEST_TOKEN
    from huggingface_hub import HfApi

    from speedtronic.testing.hub_server import HubEmulator

    unknown, refused, read_only = "hf_unknownTOKEN_1111", "hf_refusedTOKEN_2222", "hf_roTOKEN_3333"
    hub = HubEmulator(
        0, token=TEST_TOKEN, refused_tokens=[refused], read_only_tokens=[read_only]
    ).start()
    try:
        secrets = tmp_path / "secrets"
        secrets.mkdir()
        (secrets / "hf_token").write_text(refused + "\n")
        base = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
        sets = [*_sets(10), "distributed.retry_attempts=2"]
        cases = [  # (process, token, its source as the error names it)
            (Proc(tmp_path, "w404", "worker", sets, child_env(**base, HF_TOKEN=unknown)),
             unknown, "env:HF_TOKEN"),
            (Proc(tmp_path, "m401", "master", sets,
                  child_env(**base, SPEEDTRONIC_SECRETS_DIR=str(secrets))),
             refused, "secret:hf_token"),
            (Proc(tmp_path, "w403", "worker", sets, child_env(**base, HF_TOKEN=read_only)),
             read_only, "env:HF_TOKEN"),
        ]  # fmt: skip
        HfApi(endpoint=hub.url, token=TEST_TOKEN).create_repo("org/run", private=True)
        for proc, _, _ in cases:
            proc.repo = "org/run"
            proc.start()
        for proc, token, source in cases:
            assert proc.wait(120, *(p for p, _, _ in cases)) == 2, tails(proc)
            output = proc.out.read_text()
            errors = [line for line in output.splitlines() if line.startswith("error:")]
            assert len(errors) == 1, tails(proc)
            assert "org/run" in errors[0] and source in errors[0], errors
            assert token not in output, f"{proc.name} printed its token"
    finally:
        hub.stop()
