"""Text logs a person reads (issue 29): short step lines, no None/null, the exchange's wire
formats at start; the JSONL record keeps every field."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

from process_support import run_speedtronic

from speedtronic.metrics import MetricLogger
from speedtronic.metrics.lines import STEP_LINE_LIMIT

ROOT = Path(__file__).resolve().parents[1]

#: A train_step payload as the trainer emits it, with every figure as wide as it gets.
WIDE_STEP = {
    "step": 123_456_789,
    "loss": 12.345678901,
    "lr": 0.000123456789,
    "grad_norm": 1234.56789,
    "steps_per_sec": 1234.5678,
    "samples_per_sec": 12345678.9,
    "tokens_per_sec": 123456789.123,
    "samples": 123_456_789_012,
    "tokens": 123_456_789_012_345,
    "micro_batches": 64,
    "step_time_s": 0.000123456,
}


def _lines(logger: MetricLogger, stream: io.StringIO) -> list[str]:
    logger.close()
    return stream.getvalue().splitlines()


def test_a_step_line_holds_the_watched_figures_within_the_limit(tmp_path):
    stream = io.StringIO()
    logger = MetricLogger(stream=stream, json_file=tmp_path / "events.jsonl")
    logger.emit("train_start", {"start_step": 0, "target_step": 999_999_999})
    logger.emit("diloco_started", {"role": "worker", "node_id": "w1", "global_step": 0})
    logger.emit("eval", {"step": 0, "loss": 4.901234, "perplexity": 134.4, "scope": "local"})
    logger.emit("global_pulled", {"outer_step": 123_456, "step": 0, "source": "full"})
    logger.emit("train_step", dict(WIDE_STEP))
    step_line = next(line for line in _lines(logger, stream) if "train_step" in line)
    assert len(step_line) <= STEP_LINE_LIMIT == 160, (len(step_line), step_line)
    assert step_line.endswith(
        "train_step step=123456789/999999999 loss=12.3457 lr=0.000123 tok/s=123456789 "
        "eval=4.9012 outer_step=123456"
    ), step_line
    # everything else stays in the JSONL record, under its own name
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["event"] == "train_step")
    assert {key: step[key] for key in WIDE_STEP} == WIDE_STEP and "elapsed_s" in step


def test_a_diloco_step_line_shows_its_last_rounds_train_and_wait_seconds(tmp_path):
    """After a contribution (``round_done``) every step line carries the seconds its last round
    trained and waited on the exchange, within the limit with every figure as wide as it
    gets; the round's own line and its JSONL record say the rest."""
    stream = io.StringIO()
    logger = MetricLogger(stream=stream, json_file=tmp_path / "events.jsonl")
    logger.emit("train_start", {"start_step": 0, "target_step": 999_999_999})
    logger.emit("eval", {"step": 0, "loss": 4.901234, "perplexity": 134.4, "scope": "local"})
    logger.emit("global_pulled", {"outer_step": 123_456, "step": 0, "source": "full"})
    logger.emit("train_step", dict(WIDE_STEP, step=123_456_788))
    done = {"round": 7, "step": 123_456_789, "final": False}
    done.update(compute_seconds=998.7, wait_seconds=123.4567, utilization=0.8899)
    logger.emit("round_done", done)
    logger.emit("train_step", dict(WIDE_STEP))
    logger.emit("round_done", dict(done, compute_seconds=6.4321, wait_seconds=0.04))
    logger.emit("train_step", dict(WIDE_STEP, step=123_456_790))
    lines = _lines(logger, stream)
    steps = [line for line in lines if "train_step" in line]
    assert steps[0].endswith("outer_step=123456"), steps[0]  # no round yet
    assert len(steps[1]) <= STEP_LINE_LIMIT, (len(steps[1]), steps[1])
    assert steps[1].endswith("eval=4.9012 outer_step=123456 train/wait=999/123s"), steps[1]
    assert steps[2].endswith(" train/wait=6.4/0.0s"), steps[2]
    round_line = next(line for line in lines if "round_done" in line)
    assert round_line.endswith(
        "round_done round=7 step=123456789 compute_seconds=999 wait_seconds=123 utilization=0.890"
    ), round_line
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert next(r for r in records if r["event"] == "round_done")["wait_seconds"] == 123.4567


def test_without_diloco_or_eval_a_step_line_names_neither():
    stream = io.StringIO()
    logger = MetricLogger(stream=stream)
    logger.emit("train_start", {"start_step": 0, "target_step": 20})
    logger.emit("train_step", {"step": 1, "loss": 4.0, "lr": 1e-3, "tokens_per_sec": 512.4})
    line = _lines(logger, stream)[-1]
    assert line.endswith("train_step step=1/20 loss=4.0000 lr=0.001 tok/s=512"), line
    assert "outer_step" not in line and "eval" not in line


def test_no_field_is_printed_as_none_and_quiet_counters_are_left_out(tmp_path):
    stream = io.StringIO()
    logger = MetricLogger(stream=stream, json_file=tmp_path / "e.jsonl")
    logger.emit("train_start", {"start_step": 0, "shape_alignment": None, "ooo_backprop": None})
    logger.emit("eval", {"step": 6, "outer_step": None, "loss": 2.0, "scope": "local"})
    logger.emit(
        "outer_step",
        {
            "outer_step": 3,
            "round": 2,
            "reason": "complete",
            "included": ["a/2", "b/2"],
            "deltas_late": 0,
            "deltas_corrupt": 1,
            "dropped": [],
        },
    )
    logger.emit("sync_wait", {"outer_step": 3, "seconds": 0.5, "timed_out": False})
    logger.emit("custom_event", {"what": None, "count": 2})
    text = "\n".join(_lines(logger, stream))
    assert "None" not in text and "null" not in text, text
    assert "outer_step outer_step=3 round=2 reason=complete included=['a/2', 'b/2'] " in text
    assert "deltas_corrupt=1" in text and "deltas_late" not in text and "dropped" not in text
    assert "timed_out" not in text and "custom_event count=2" in text
    assert "elapsed_s" not in text  # the logger's own timer is in the JSONL record only
    records = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert records[1]["outer_step"] is None and records[2]["deltas_late"] == 0  # kept there


def test_an_events_own_elapsed_time_is_shown():
    stream = io.StringIO()
    logger = MetricLogger(stream=stream)
    logger.emit("train_end", {"steps": 20, "elapsed_s": 12.3456, "loss": None})
    assert _lines(logger, stream)[-1].endswith("train_end steps=20 elapsed_s=12.3")


def test_json_format_keeps_every_field():
    stream = io.StringIO()
    logger = MetricLogger(stream=stream, format="json")
    logger.emit("train_step", dict(WIDE_STEP))
    record = json.loads(_lines(logger, stream)[-1])
    assert record["event"] == "train_step" and record["fields"]["grad_norm"] == 1234.56789


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("SPEEDTRONIC_")}
    return run_speedtronic(*args, cwd=tmp_path, env=env, timeout=240)


def test_smoke_train_output_reads_well(tmp_path):
    """`speedtronic train --config configs/smoke.yaml` (20 steps): every step line within the
    limit, nothing printed as None/null, and a finish line without a stop reason."""
    out = tmp_path / "run"
    config = str(ROOT / "configs" / "smoke.yaml")
    done = _cli(
        tmp_path, "train", "--config", config, "--max-steps", "20", "--output-dir", f"{out}"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    steps = [line for line in lines if " train_step " in line]
    assert len(steps) == 20 and all(len(line) <= STEP_LINE_LIMIT for line in steps), steps
    assert "step=20/20 loss=" in steps[-1] and "eval=" in steps[-1]
    assert "outer_step" not in steps[-1]
    assert not [line for line in lines if "None" in line or "null" in line], done.stdout
    assert any(line.endswith("| devices: cpu, precision fp32") for line in lines), done.stdout
    assert any(line.endswith("run finished after 20 steps") for line in lines), done.stdout
    assert not [line for line in lines if "exchange:" in line]  # no DiLoCo, no exchange line
    records = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["event"] == "train_step")
    assert {"grad_norm", "samples_per_sec", "step_time_s", "micro_batches"} <= set(step)


def test_a_diloco_run_says_its_wire_formats_at_start(tmp_path):
    exchange = tmp_path / "exchange"
    done = _cli(
        tmp_path,
        "run",
        "--config",
        str(ROOT / "configs" / "diloco.yaml"),
        "--max-steps",
        "40",
        "--output-dir",
        str(tmp_path / "master"),
        "--set",
        f"distributed.repo_id=file://{exchange}",
        "--set",
        "distributed.delta_dtype=int8",
        "--set",
        "distributed.global_dtype=int4",
        "--set",
        "metrics.enabled=false",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    wire = [line for line in lines if "| exchange: " in line]
    assert len(wire) == 1, done.stdout
    assert "deltas up as int8 (blocks of 128), global down as int4" in wire[0], wire
    assert f"file://{exchange} as master, node " in wire[0], wire
    steps = [line for line in lines if " train_step " in line]
    assert steps and all(len(line) <= STEP_LINE_LIMIT for line in steps), steps
    assert "outer_step=2" in steps[-1], steps[-1]
    assert not [line for line in lines if "None" in line or "null" in line], done.stdout
    assert not [line for line in lines if "| WARNING |" in line], done.stdout
