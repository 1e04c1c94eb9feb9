"""MetricLogger: text and JSON lines, JSONL records, cadence, hooks, redaction, adapters, plot."""

from __future__ import annotations

import io
import json
import threading

import pytest

from speedtronic.hooks import on_event
from speedtronic.metrics import CallbackList, MetricLogger
from speedtronic.metrics.plot import plot_command, read_train_steps

TOKEN = "hf_SECRETTOKEN123456"


def test_text_line_format():
    stream = io.StringIO()
    logger = MetricLogger(stream=stream)
    logger.emit("train_step", {"step": 1, "loss": 4.852031, "lr": 3e-4, "ok": True})
    line = stream.getvalue().strip()
    assert " | INFO | train_step step=1 loss=4.85203 lr=0.0003 ok=True elapsed_s=" in line


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
    from speedtronic.integrations import TensorboardHook, WandbHook

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
