"""MetricLogger: text and JSON lines, JSONL records, cadence, hooks, redaction, adapters, plot."""

from __future__ import annotations

import io
import json
import threading

import pytest

from speedtronic.metrics import CallbackList, MetricLogger
from speedtronic.metrics.hooks import on_event
from speedtronic.metrics.plot import plot_command, read_train_steps

TOKEN = "hf_SECRETTOKEN123456"


def test_text_line_format():
    stream = io.StringIO()
    logger = MetricLogger(stream=stream)
    logger.emit("train_step", {"step": 1, "loss": 4.852031, "lr": 3e-4, "ok": True})
    line = stream.getvalue().strip()
    # issue 29: a step line shows the watched figures only (the rest is in the JSONL record)
    assert line.endswith(" | INFO | train_step step=1 loss=4.8520 lr=0.0003"), line


def test_jsonl_records_and_cadence(tmp_path):
    path = tmp_path / "logs" / "events.jsonl"
    logger = MetricLogger(stream=io.StringIO(), json_file=path, every_steps=2)
    for step in range(1, 5):
        logger.emit("train_step", {"step": step, "loss": 1.0 / step})
    logger.emit("checkpoint_saved", {"step": 4, "path": "x", "seconds": 0.1})
    logger.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["train_step", "train_step", "checkpoint_saved"]
    assert [r["step"] for r in records] == [2, 4, 4]
    assert list(records[0])[:3] == ["event", "step", "loss"] and "elapsed_s" in records[0]


def test_hooks_callables_objects_cadence_and_wants_all_steps():
    logger = MetricLogger(stream=io.StringIO(), every_steps=3)
    plain: list = []

    class AllSteps:
        wants_all_steps = True

        def __init__(self):
            self.steps = []

        def on_event(self, event, payload):
            if event == "train_step":
                self.steps.append(payload["step"])

    every = AllSteps()
    logger.hooks.append(lambda event, payload: plain.append((event, payload.get("step"))))
    logger.hooks.append(every)
    for step in range(1, 7):
        logger.emit("train_step", {"step": step})
    logger.emit("train_end", {"steps": 6})
    assert plain == [("train_step", 3), ("train_step", 6), ("train_end", None)]
    assert every.steps == [1, 2, 3, 4, 5, 6]


def test_failing_hook_is_a_warning_not_a_crash():
    stream = io.StringIO()
    logger = MetricLogger(stream=stream)
    seen = []

    def broken(event, payload):
        raise RuntimeError("boom")

    logger.hooks.extend([broken, lambda e, p: seen.append(e)])
    logger.emit("train_start", {})
    assert seen == ["train_start"]
    assert "WARNING | metric hook failed: boom" in stream.getvalue()


def test_json_format_lines():
    stream = io.StringIO()
    logger = MetricLogger(stream=stream, format="json")
    logger.emit("train_step", {"step": 2, "loss": 1.5})
    logger.warning("disk %s is slow", "/x")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["event"] == "train_step" and first["fields"]["loss"] == 1.5
    assert first["level"] == "INFO" and first["logger"] == "speedtronic" and "ts" in first
    assert second == {**second, "level": "WARNING", "message": "disk /x is slow"}


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_secret_never_written(tmp_path, fmt):
    stream = io.StringIO()
    path = tmp_path / "e.jsonl"
    logger = MetricLogger(stream=stream, json_file=path, format=fmt, secrets=[TOKEN, None])
    logger.emit("delta_upload_failed", {"step": 1, "error": f"401 for token {TOKEN}"})
    logger.warning("request with %s failed", TOKEN)
    logger.close()
    text = stream.getvalue() + path.read_text()
    assert TOKEN not in text and "<redacted>" in text


def test_emit_is_thread_safe(tmp_path):
    path = tmp_path / "e.jsonl"
    logger = MetricLogger(stream=io.StringIO(), json_file=path)

    def spam(name):
        for i in range(50):
            logger.emit(name, {"i": i, "blob": "x" * 200})

    threads = [threading.Thread(target=spam, args=(f"t{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    logger.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 200 and all(json.loads(line)["blob"] for line in lines)


def test_file_sink_and_level(tmp_path):
    path = tmp_path / "deep" / "train.log"
    logger = MetricLogger(level="WARNING", file=path)
    logger.emit("train_step", {"step": 1})
    logger.warning("careful")
    logger.close()
    assert path.read_text().count("\n") == 1 and "careful" in path.read_text()


def test_helpers():
    seen = []
    wrapped = on_event(lambda e, p: seen.append(e))
    CallbackList([wrapped]).on_event("x", {})
    assert seen == ["x"]
    with pytest.raises(ValueError):
        MetricLogger(every_steps=0)


def test_adapters_missing_packages_are_clear(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name in {"wandb", "torch.utils.tensorboard"}:
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    from speedtronic.metrics.integrations import TensorboardHook, WandbHook

    with pytest.raises(RuntimeError, match=r"speedtronic\[logging\]"):
        WandbHook(project="x")
    with pytest.raises(RuntimeError, match=r"speedtronic\[logging\]"):
        TensorboardHook("runs/tb")


def test_plot_from_jsonl_and_run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    log = run / "events.jsonl"
    lines = [{"event": "train_start"}]
    lines += [{"event": "train_step", "step": s, "loss": 5.0 / s, "lr": 1e-3} for s in (1, 2, 3)]
    lines += [{"event": "train_step", "step": 3, "loss": 1.0, "lr": 1e-3}]  # resumed re-do
    log.write_text("\n".join(json.dumps(r) for r in lines) + "\n{torn")
    assert [r["loss"] for r in read_train_steps(log)] == [5.0, 2.5, 1.0]
    pytest.importorskip("matplotlib")
    out = plot_command(str(run), str(tmp_path / "plots" / "loss.png"))
    assert out.endswith("loss.png") and (tmp_path / "plots" / "loss.png").stat().st_size > 1000
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"event": "train_start"}) + "\n")
    with pytest.raises(ValueError, match="no train_step"):
        plot_command(str(empty), str(tmp_path / "x.png"))


def test_hooks_get_redacted_strings():
    seen = []
    logger = MetricLogger(
        stream=io.StringIO(), secrets=[TOKEN], hooks=[lambda e, p: seen.append(p)]
    )
    logger.emit("transport_retry", {"operation": "upload", "error": f"bad {TOKEN}"})
    assert seen[0]["error"] == "bad <redacted>"


def test_every_jsonl_record_carries_the_run_id(tmp_path):
    path = tmp_path / "events.jsonl"
    first = MetricLogger(stream=io.StringIO(), json_file=path)
    first.emit("train_start", {"start_step": 0})
    first.emit("train_step", {"step": 1, "loss": 1.0})
    first.close()
    second = MetricLogger(stream=io.StringIO(), json_file=path, run_id="mine")
    second.emit("train_step", {"step": 1, "loss": 2.0})
    second.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["run_id"] for r in records] == [first.run_id, first.run_id, "mine"]
    assert first.run_id != MetricLogger(stream=io.StringIO()).run_id
    assert len(first.run_id) == len("20261203T160512Z-3f9a1c")


def _log(path, *runs):
    """Write runs of (run_id, start_step, [(step, loss)], [(step, eval loss)]) to ``path``."""
    lines = []
    for run_id, start, steps, evals in runs:
        tag = {} if run_id is None else {"run_id": run_id}
        lines.append({"event": "train_start", "start_step": start, **tag})
        lines += [
            {"event": "train_step", "step": s, "loss": v, "lr": 1e-3, **tag} for s, v in steps
        ]
        lines += [{"event": "eval", "step": s, "loss": v, **tag} for s, v in evals]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plot_reads_the_last_run_joined_with_the_runs_it_resumed(tmp_path):
    from speedtronic.metrics.plot import last_run, read_eval_points, read_runs

    log = tmp_path / "events.jsonl"
    _log(
        log,
        ("old", 0, [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0)], [(4, 6.5)]),  # an earlier run
        ("a", 0, [(1, 5.0), (2, 4.0), (3, 3.5)], [(0, 5.5)]),  # crashed after step 3
        ("short", 0, [(1, 9.5)], []),  # a fresh run stopped at step 1: not what b resumed
        ("b", 2, [(3, 3.0), (4, 2.0)], [(2, 4.2), (4, 2.5)]),  # resumed from step 2
    )
    runs = read_runs(log)
    assert [(r.run_id, r.start_step) for r in runs] == [
        ("old", 0),
        ("a", 0),
        ("short", 0),
        ("b", 2),
    ]
    assert [r.run_id for r in last_run(runs)] == ["a", "b"]
    # steps 1-2 from a, 3-4 from b (a's step 3 was re-done); the older run is not mixed in
    assert [(r["step"], r["loss"]) for r in read_train_steps(log)] == [
        (1, 5.0),
        (2, 4.0),
        (3, 3.0),
        (4, 2.0),
    ]
    assert read_eval_points(log) == {"local": [(0, 5.5), (2, 4.2), (4, 2.5)]}


def test_plot_splits_logs_without_run_ids_at_train_start(tmp_path):
    """The issue's case: a 4-step smoke run appended to older runs' file drew 37 "steps" and
    a learning rate that jumped back up. Old logs (no run ids) split at each train_start."""
    from speedtronic.metrics.plot import read_runs

    log = tmp_path / "events.jsonl"
    _log(
        log,
        (None, 0, [(s, 1.0) for s in range(1, 34)], []),
        (None, 0, [(s, 2.0) for s in range(1, 5)], []),
    )
    assert [len(run.train_steps) for run in read_runs(log)] == [33, 4]
    assert [r["loss"] for r in read_train_steps(log)] == [2.0] * 4


def test_plot_draws_the_last_run_or_each_run(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    log = tmp_path / "events.jsonl"
    _log(log, ("a", 0, [(1, 5.0), (2, 4.0)], [(2, 4.5)]), ("b", 0, [(1, 3.0), (2, 2.0)], []))
    last = plot_command(str(log), str(tmp_path / "last.png"))
    each = plot_command(str(log), str(tmp_path / "each.png"), each_run=True)
    assert imread(last).shape == imread(each).shape
    assert (imread(last) != imread(each)).any()
