"""PrometheusSink and MetricsServer in-process: names, labels, counting, health and readiness."""

from __future__ import annotations

import json
import math
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from speedtronic.config import ConfigError
from speedtronic.metrics.prometheus import SERIES, UPLOAD_RESULTS, PrometheusSink
from speedtronic.metrics.server import MetricsPortInUse, MetricsServer

PER_PEER = "speedtronic_diloco_node_last_seen_seconds"


def samples(sink: PrometheusSink) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} parsed by prometheus_client's own text parser."""
    text = generate_latest(sink.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(sink: PrometheusSink, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"role": sink.role, "node_id": sink.node_id, **labels}.items())))
    return samples(sink)[key]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_every_documented_series_is_exposed_with_role_and_node_id_labels():
    sink = PrometheusSink("worker", "w-1")
    sink.on_event("transport_retry", {"operation": "upload", "attempt": 1, "error": "x"})
    sink.on_event("eval", {"step": 1, "loss": 3.0, "tokens": 64, "scope": "local"})
    names = {name for name, _ in samples(sink)}
    for series in SERIES:
        if series == PER_PEER:
            continue  # a master's, one sample per node (test_membership_is_read_at_scrape_time)
        # Histograms expose _count/_sum/_bucket under the documented base name.
        assert series in names or f"{series}_count" in names, series
    for (name, labels), _ in samples(sink).items():
        keys = dict(labels)
        assert keys["role"] == "worker" and keys["node_id"] == "w-1", name
        assert set(keys) <= {"role", "node_id", "result", "operation", "scope", "le"}, name
    for series in SERIES:
        assert series.startswith("speedtronic_")


def test_train_steps_count_increments_and_gauges_follow_the_last_step():
    clock = FakeClock()
    sink = PrometheusSink("single", "n", clock=clock)
    assert sink.wants_all_steps is True
    sink.on_event("train_start", {"start_step": 0})
    for step in (1, 2, 3):
        clock.now += 0.5
        sink.on_event(
            "train_step",
            {
                "step": step,
                "loss": 5.0 - step,
                "lr": 1e-3 * step,
                "samples": 2 * step,
                "tokens": 64 * step,
                "tokens_per_sec": 128.0,
                "memory_bytes": 4096,
            },
        )
    assert value(sink, "speedtronic_train_steps_total") == 3
    assert value(sink, "speedtronic_train_samples_total") == 6
    assert value(sink, "speedtronic_train_tokens_total") == 192
    assert value(sink, "speedtronic_train_step") == 3
    assert value(sink, "speedtronic_train_loss") == 2.0
    assert value(sink, "speedtronic_train_learning_rate") == pytest.approx(3e-3)
    assert value(sink, "speedtronic_train_tokens_per_second") == 128.0
    assert value(sink, "speedtronic_memory_bytes") == 4096
    # Without step_time_s the histogram uses the time between train_step events.
    assert value(sink, "speedtronic_train_step_seconds_count") == 2
    assert value(sink, "speedtronic_train_step_seconds_sum") == pytest.approx(1.0)
    clock.now += 7
    assert value(sink, "speedtronic_seconds_since_last_step") == pytest.approx(7.0)


def test_resumed_run_counts_only_this_process_work():
    sink = PrometheusSink("single", "n")
    sink.on_event("train_start", {"start_step": 100})
    sink.on_event("train_step", {"step": 101, "samples": 202, "tokens": 6464})
    sink.on_event("train_step", {"step": 102, "samples": 204, "tokens": 6528})
    assert value(sink, "speedtronic_train_steps_total") == 2
    assert value(sink, "speedtronic_train_samples_total") == 2
    assert value(sink, "speedtronic_train_tokens_total") == 64
    assert value(sink, "speedtronic_train_step") == 102


def test_checkpoint_and_skipped_step_events():
    sink = PrometheusSink("single", "n")
    sink.on_event("checkpoint_saved", {"step": 2, "path": "/x", "seconds": 0.25})
    sink.on_event("checkpoint", {"step": 4, "path": "/y"})
    sink.on_event("optimizer_step_skipped", {"step": 5, "reason": "grad_scaler_overflow"})
    sink.on_event("nonfinite_loss", {"step": 6, "loss": float("nan")})
    assert value(sink, "speedtronic_checkpoint_saves_total") == 2
    assert value(sink, "speedtronic_checkpoint_save_seconds_count") == 1
    assert value(sink, "speedtronic_train_skipped_steps_total") == 2


def test_diloco_events_drive_the_diloco_series():
    clock = FakeClock()
    sink = PrometheusSink("master", "m", clock=clock)
    sink.on_event("diloco_started", {"role": "master", "node_id": "m", "global_step": 3})
    assert value(sink, "speedtronic_diloco_outer_step") == 3
    sink.on_event(
        "outer_step",
        {
            "outer_step": 4,
            "deltas_found": 3,
            "deltas_included": 2,
            "deltas_late": 1,
            "deltas_stale": 2,
            "deltas_skipped": 1,
            "deltas_corrupt": 0,
            "seconds": 0.1,
            "round_seconds": 12.5,
            "nodes_active": 3,
            "eta": 1.4172,
        },
    )
    sink.on_event("outer_step", {"outer_step": 5, "deltas_found": 1, "deltas_corrupt": 1})
    assert value(sink, "speedtronic_diloco_rounds_total") == 2
    assert value(sink, "speedtronic_diloco_outer_step") == 5
    assert value(sink, "speedtronic_diloco_deltas_found_total") == 4
    assert value(sink, "speedtronic_diloco_deltas_included_total") == 2
    assert value(sink, "speedtronic_diloco_deltas_skipped_total") == 1
    assert value(sink, "speedtronic_diloco_deltas_corrupt_total") == 1
    assert value(sink, "speedtronic_diloco_deltas_late_total") == 1
    assert value(sink, "speedtronic_diloco_deltas_stale_total") == 2
    assert value(sink, "speedtronic_diloco_round_seconds") == 12.5
    assert value(sink, "speedtronic_diloco_nodes_active") == 3
    assert value(sink, "speedtronic_diloco_outer_lr") == 1.4172
    # files refused once every node was done, reported with the final global, not a round
    sink.on_event("final_global", {"outer_step": 5, "deltas_corrupt": 2, "dropped": []})
    assert value(sink, "speedtronic_diloco_deltas_corrupt_total") == 3
    assert value(sink, "speedtronic_diloco_rounds_total") == 2
    sink.on_event("global_rejected", {"outer_step": 9, "error": "non-finite"})
    assert value(sink, "speedtronic_diloco_globals_rejected_total") == 1
    sink.on_event("node_dropped", {"node_id": "w9", "silent_seconds": 400})
    assert value(sink, "speedtronic_diloco_nodes_dropped_total") == 1
    sink.on_event("sync_wait", {"outer_step": 5, "seconds": 2.0, "timed_out": False})
    sink.on_event("sync_wait", {"outer_step": 6, "seconds": 30.0, "timed_out": True})
    assert value(sink, "speedtronic_diloco_sync_wait_seconds_count") == 2
    assert value(sink, "speedtronic_diloco_sync_wait_seconds_sum") == 32.0
    assert value(sink, "speedtronic_diloco_sync_timeouts_total") == 1

    sink.on_event("delta_uploaded", {"step": 10, "bytes": 1000, "seconds": 0.5})
    sink.on_event("delta_upload_failed", {"step": 20, "error": "boom"})
    sink.on_event("delta_upload_zero", {"step": 50})
    for result in UPLOAD_RESULTS:
        assert value(sink, "speedtronic_diloco_uploads_total", result=result) == 1, result
    assert value(sink, "speedtronic_diloco_upload_bytes_total") == 1000
    assert value(sink, "speedtronic_diloco_upload_seconds_count") == 1

    clock.now += 30
    assert value(sink, "speedtronic_diloco_seconds_since_last_global_sync") == pytest.approx(30)
    sink.on_event("global_pulled", {"outer_step": 6, "seconds": 0.2})
    assert value(sink, "speedtronic_diloco_global_pulls_total") == 1
    assert value(sink, "speedtronic_diloco_outer_step") == 6
    assert value(sink, "speedtronic_diloco_seconds_since_last_global_sync") == pytest.approx(0)

    sink.on_event("transport_retry", {"operation": "download", "attempt": 1, "error": "x"})
    sink.on_event("transport_retry", {"operation": "download", "attempt": 2, "error": "x"})
    assert value(sink, "speedtronic_diloco_retries_total", operation="download") == 2


def test_a_nodes_rounds_drive_its_utilization_and_its_exchange_wait_counter():
    """``round_done`` (one per contribution): the gauge holds the last round's compute /
    (compute + wait), the counter adds up the seconds waited; both read back from the text
    format as Prometheus parses it."""
    sink = PrometheusSink("worker", "w1")
    assert math.isnan(value(sink, "speedtronic_diloco_utilization"))  # no round yet
    assert value(sink, "speedtronic_diloco_exchange_wait_seconds_total") == 0
    rounds = [(6.0, 2.0), (7.5, 0.5), (3.0, 9.0)]  # (compute, wait) seconds
    for number, (compute, wait) in enumerate(rounds):
        util = compute / (compute + wait)
        fields = {"round": number, "step": 20 * (number + 1), "final": False}
        fields.update(compute_seconds=compute, wait_seconds=wait, utilization=util)
        sink.on_event("round_done", fields)
        assert value(sink, "speedtronic_diloco_utilization") == pytest.approx(util)
    assert value(sink, "speedtronic_diloco_utilization") == pytest.approx(0.25)
    assert value(sink, "speedtronic_diloco_exchange_wait_seconds_total") == pytest.approx(11.5)
    # a payload that is not a round's figures changes nothing
    sink.on_event("round_done", {"round": 3, "utilization": "high", "wait_seconds": -1.0})
    assert value(sink, "speedtronic_diloco_utilization") == pytest.approx(0.25)
    assert value(sink, "speedtronic_diloco_exchange_wait_seconds_total") == pytest.approx(11.5)
    text = generate_latest(sink.registry).decode()
    assert "# TYPE speedtronic_diloco_utilization gauge" in text
    assert "# TYPE speedtronic_diloco_exchange_wait_seconds_total counter" in text


def test_unknown_events_and_odd_payloads_are_ignored():
    sink = PrometheusSink("single", "n")
    sink.on_event("something_new", {"step": "x"})
    sink.on_event("train_step", {"step": None, "loss": "nan?", "lr": True})
    assert value(sink, "speedtronic_train_steps_total") == 0


def test_token_never_reaches_labels_or_values():
    sink = PrometheusSink("worker", "w")
    sink.on_event("transport_retry", {"operation": "upload", "error": "token hf_secret"})
    assert "hf_secret" not in generate_latest(sink.registry).decode()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_server_serves_metrics_health_and_readiness():
    clock = FakeClock()
    sink = PrometheusSink("single", "n")
    state = {"beat": None, "ready": False}
    server = MetricsServer(
        "127.0.0.1",
        0,
        sink,
        heartbeat=lambda: state["beat"],
        ready=lambda: state["ready"],
        stall_seconds=10,
        clock=clock,
    )
    with server:
        base = f"http://127.0.0.1:{server.port}"
        code, body = get(base + "/metrics")
        assert code == 200 and b"speedtronic_train_steps_total" in body
        assert get(base + "/healthz")[0] == 200  # start-up counts as a heartbeat
        assert get(base + "/readyz")[0] == 503
        state["ready"] = True
        assert get(base + "/readyz")[0] == 200
        clock.now += 11
        code, body = get(base + "/healthz")
        assert code == 503 and json.loads(body)["heartbeat_age_seconds"] == 11
        state["beat"] = clock.now - 1
        assert get(base + "/healthz")[0] == 200
        state["ready"] = None  # a readiness callback that breaks counts as not ready

        def broken() -> bool:
            raise RuntimeError("no")

        server.ready = broken
        assert get(base + "/readyz")[0] == 503
        assert get(base + "/nope")[0] == 404


def test_port_in_use_is_a_config_error_naming_metrics_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(MetricsPortInUse) as info:
            MetricsServer("127.0.0.1", port, PrometheusSink("single", "n"))
    assert isinstance(info.value, ConfigError)
    assert "metrics.port" in str(info.value) and str(port) in str(info.value)


def test_eval_loss_gauge_has_one_series_per_scope():
    sink = PrometheusSink("master", "m")
    assert not any(name == "speedtronic_eval_loss" for name, _ in samples(sink))  # no eval yet
    sink.on_event("eval", {"step": 10, "loss": 2.5, "perplexity": 12.2, "tokens": 64})
    sink.on_event("eval", {"step": 10, "loss": 2.25, "tokens": 64, "scope": "global"})
    sink.on_event("eval", {"step": 20, "loss": 2.0, "tokens": 64, "scope": "local"})
    sink.on_event("eval", {"step": 20, "loss": 9.0, "tokens": 64, "scope": "bogus"})  # ignored
    sink.on_event("eval", {"step": 20, "tokens": 64, "scope": "global"})  # no loss: ignored
    assert value(sink, "speedtronic_eval_loss", scope="local") == 2.0
    assert value(sink, "speedtronic_eval_loss", scope="global") == 2.25
    scopes = {
        dict(labels)["scope"] for name, labels in samples(sink) if name == "speedtronic_eval_loss"
    }
    assert scopes == {"local", "global"}


def test_membership_is_read_at_scrape_time():
    """Issue 40: a master's nodes_active and each node's last-seen seconds follow its roster
    between rounds (read when scraped); a worker exposes no per-node series."""
    roster = {"found": (2, {"w1": 1.5, "w2": 12.0})}
    master = PrometheusSink("master", "m")
    master.watch_membership(lambda: roster["found"])
    assert value(master, "speedtronic_diloco_nodes_active") == 2
    assert value(master, PER_PEER, peer="w1") == 1.5
    assert value(master, PER_PEER, peer="w2") == 12.0
    roster["found"] = (1, {"w1": 0.2})  # w2 left
    assert value(master, "speedtronic_diloco_nodes_active") == 1
    assert [dict(k[1])["peer"] for k in samples(master) if k[0] == PER_PEER] == ["w1"]
    worker = PrometheusSink("worker", "w1")
    worker.watch_membership(lambda: None)
    assert not [k for k in samples(worker) if k[0] == PER_PEER]
