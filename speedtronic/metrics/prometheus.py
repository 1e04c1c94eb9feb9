"""Prometheus exporter: a metrics hook that turns training and DiLoCo events into series.

`PrometheusSink` is attached to the trainer's `MetricLogger` like any other hook
(``trainer.logger.hooks.append(sink)``). It sets ``wants_all_steps = True`` so the logger
hands it every ``train_step`` event regardless of the text log cadence. It owns its own
`CollectorRegistry` (no global state), which `speedtronic.metrics.server.MetricsServer`
serves on ``/metrics``.

Every series carries the labels ``role`` and ``node_id`` (never the token). Four series have one
extra bounded label: ``speedtronic_diloco_uploads_total{result}``,
``speedtronic_diloco_retries_total{operation}``, ``speedtronic_eval_loss{scope}`` (``local``:
a node's own weights, ``global``: the DiLoCo global the master evaluated) and, on a master,
``speedtronic_diloco_node_last_seen_seconds{peer}`` (one per training node of the run, read
from the master's roster at scrape time with ``speedtronic_diloco_nodes_active``:
:meth:`PrometheusSink.watch_membership`). The list of series is `SERIES`; docs/deploy.md
documents the same list.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from speedtronic.json_types import JSONView

_Series = TypeVar("_Series", Counter, Gauge)

__all__ = ["EVAL_SCOPES", "SERIES", "UPLOAD_RESULTS", "PrometheusSink"]

# Exposed sample name -> help text. Counters are listed with their `_total` sample name and
# histograms with their base name (Prometheus adds `_bucket`, `_sum`, `_count`).
SERIES: dict[str, str] = {
    "speedtronic_train_steps_total": "Optimizer steps applied by this process.",
    "speedtronic_train_tokens_total": "Tokens trained on by this node (all its ranks).",
    "speedtronic_train_samples_total": "Samples trained on by this node (all its ranks).",
    "speedtronic_train_step": "Current absolute global step (includes resumed steps).",
    "speedtronic_train_loss": "Mean microbatch loss of the last applied update.",
    "speedtronic_train_learning_rate": "Learning rate after the last scheduler step.",
    "speedtronic_train_step_seconds": "Wall time of one optimizer step.",
    "speedtronic_train_tokens_per_second": "Tokens per second of all ranks since fit() began.",
    "speedtronic_train_skipped_steps_total": "Updates skipped (GradScaler overflow, non-finite).",
    "speedtronic_memory_bytes": "Accelerator memory allocated (host RSS when no accelerator).",
    "speedtronic_seconds_since_last_step": "Seconds since the last applied step (or start).",
    "speedtronic_checkpoint_saves_total": "Checkpoints written.",
    "speedtronic_checkpoint_save_seconds": "Time to write one checkpoint.",
    "speedtronic_eval_loss": "Held-out loss (mean token cross-entropy, nats) of the last eval.",
    "speedtronic_diloco_outer_step": "Latest known DiLoCo outer (global) step.",
    "speedtronic_diloco_rounds_total": "DiLoCo outer rounds run by the master.",
    "speedtronic_diloco_deltas_found_total": "Deltas found by the master's outer rounds.",
    "speedtronic_diloco_deltas_included_total": "Deltas averaged into a global update.",
    "speedtronic_diloco_deltas_late_total": "Included deltas that arrived after their round.",
    "speedtronic_diloco_deltas_stale_total": "Deltas dropped: later than max_staleness rounds.",
    "speedtronic_diloco_deltas_skipped_total": "Deltas skipped as replays of aggregated ones.",
    "speedtronic_diloco_deltas_corrupt_total": "Deltas that could not be read.",
    "speedtronic_diloco_round_seconds": "Length of the last closed round (master).",
    "speedtronic_diloco_nodes_active": "Nodes the open round waits for (master).",
    "speedtronic_diloco_node_last_seen_seconds": "Seconds since the master last saw a node.",
    "speedtronic_diloco_outer_lr": "Outer lr of the last closed round (adaptive: its eta).",
    "speedtronic_diloco_nodes_dropped_total": "Nodes no longer waited for after silence (master).",
    "speedtronic_diloco_sync_wait_seconds": "Time a node waited for the global of its round.",
    "speedtronic_diloco_utilization": (
        "Compute share of this node's last round: compute / (compute + exchange wait)."
    ),
    "speedtronic_diloco_exchange_wait_seconds_total": (
        "Seconds this node's training waited on the exchange at its round boundaries."
    ),
    "speedtronic_diloco_sync_timeouts_total": "Waits for a global that ended at round_timeout.",
    "speedtronic_diloco_uploads_total": "Delta uploads by result (ok, failed, zero).",
    "speedtronic_diloco_upload_bytes_total": "Bytes of delta files uploaded.",
    "speedtronic_diloco_upload_seconds": "Time to upload one delta.",
    "speedtronic_diloco_global_pulls_total": "Global states pulled and installed.",
    "speedtronic_diloco_globals_rejected_total": "Published globals refused (size, non-finite).",
    "speedtronic_diloco_retries_total": "Transport retries by operation.",
    "speedtronic_diloco_seconds_since_last_global_sync": "Seconds since the last global sync.",
}

UPLOAD_RESULTS = ("ok", "failed", "zero")
EVAL_SCOPES = ("local", "global")

_UPLOAD_EVENTS = {
    "delta_uploaded": "ok",
    "delta_upload_failed": "failed",
    "delta_upload_zero": "zero",
}
_DELTA_KINDS = ("found", "included", "late", "stale", "skipped", "corrupt")

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_IO_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)


def _host_rss_bytes() -> float:
    """Resident set size of this process in bytes (Linux /proc), NaN where unknown."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
        import resource

        return float(pages * resource.getpagesize())
    except (OSError, ValueError, IndexError, ImportError):
        return math.nan


def _number(payload: JSONView, key: str) -> float | None:
    """The payload value under `key` as a finite-or-not float, None when absent or not numeric."""
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class PrometheusSink:
    """Metrics hook: ``on_event(event, payload)`` updates Prometheus series.

    Args:
        role: ``single``, ``master`` or ``worker`` (a label on every series).
        node_id: this node's id (a label on every series).
        registry: where the series live; a new private `CollectorRegistry` when None.
        clock: monotonic clock in seconds (injectable for tests).
    """

    wants_all_steps = True

    def __init__(
        self,
        role: str,
        node_id: str,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.role = str(role)
        self.node_id = str(node_id)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._last_step_time: float | None = None
        self._last_sync_time: float | None = None
        self._step: int | None = None
        self._samples: int | None = None
        self._tokens: int | None = None
        self._build_series()

    # -- construction -------------------------------------------------------------------
    def _series(self, kind: type[_Series], name: str, *extra: str) -> _Series:
        labels = ("role", "node_id", *extra)
        sample = name if kind is not Counter else f"{name}_total"
        return kind(name, SERIES[sample], labels, registry=self.registry)

    def _histogram(self, name: str, buckets: tuple[float, ...]) -> Histogram:
        labels = ("role", "node_id")
        return Histogram(name, SERIES[name], labels, registry=self.registry, buckets=buckets)

    def _build_series(self) -> None:
        ids = {"role": self.role, "node_id": self.node_id}
        c, g = Counter, Gauge
        self.steps = self._series(c, "speedtronic_train_steps").labels(**ids)
        self.tokens = self._series(c, "speedtronic_train_tokens").labels(**ids)
        self.samples = self._series(c, "speedtronic_train_samples").labels(**ids)
        self.step = self._series(g, "speedtronic_train_step").labels(**ids)
        self.loss = self._series(g, "speedtronic_train_loss").labels(**ids)
        self.learning_rate = self._series(g, "speedtronic_train_learning_rate").labels(**ids)
        self.step_seconds = self._histogram("speedtronic_train_step_seconds", _STEP_BUCKETS).labels(
            **ids
        )
        self.tokens_per_second = self._series(g, "speedtronic_train_tokens_per_second").labels(
            **ids
        )
        self.skipped_steps = self._series(c, "speedtronic_train_skipped_steps").labels(**ids)
        self.memory = self._series(g, "speedtronic_memory_bytes").labels(**ids)
        self.memory.set_function(self._memory_value)
        self._device_memory: float | None = None
        self.since_step = self._series(g, "speedtronic_seconds_since_last_step").labels(**ids)
        self.since_step.set_function(self._seconds_since_step)
        self.checkpoint_saves = self._series(c, "speedtronic_checkpoint_saves").labels(**ids)
        self.checkpoint_seconds = self._histogram(
            "speedtronic_checkpoint_save_seconds", _IO_BUCKETS
        ).labels(**ids)
        self._eval_loss = self._series(g, "speedtronic_eval_loss", "scope")
        self.outer_step = self._series(g, "speedtronic_diloco_outer_step").labels(**ids)
        self.rounds = self._series(c, "speedtronic_diloco_rounds").labels(**ids)
        self.deltas = {
            kind: self._series(c, f"speedtronic_diloco_deltas_{kind}").labels(**ids)
            for kind in _DELTA_KINDS
        }
        self.round_seconds = self._series(g, "speedtronic_diloco_round_seconds").labels(**ids)
        self.nodes_active = self._series(g, "speedtronic_diloco_nodes_active").labels(**ids)
        self.outer_lr = self._series(g, "speedtronic_diloco_outer_lr").labels(**ids)
        self.nodes_dropped = self._series(c, "speedtronic_diloco_nodes_dropped").labels(**ids)
        self.sync_wait = self._histogram(
            "speedtronic_diloco_sync_wait_seconds", _IO_BUCKETS
        ).labels(**ids)
        self.sync_timeouts = self._series(c, "speedtronic_diloco_sync_timeouts").labels(**ids)
        self.utilization = self._series(g, "speedtronic_diloco_utilization").labels(**ids)
        self.utilization.set(math.nan)  # no round yet (a pure aggregator has none)
        self.exchange_wait = self._series(c, "speedtronic_diloco_exchange_wait_seconds").labels(
            **ids
        )
        uploads = self._series(c, "speedtronic_diloco_uploads", "result")
        self.uploads = {result: uploads.labels(result=result, **ids) for result in UPLOAD_RESULTS}
        self.upload_bytes = self._series(c, "speedtronic_diloco_upload_bytes").labels(**ids)
        self.upload_seconds = self._histogram(
            "speedtronic_diloco_upload_seconds", _IO_BUCKETS
        ).labels(**ids)
        self.global_pulls = self._series(c, "speedtronic_diloco_global_pulls").labels(**ids)
        self.globals_rejected = self._series(c, "speedtronic_diloco_globals_rejected").labels(**ids)
        self._retries = self._series(c, "speedtronic_diloco_retries", "operation")
        self.since_sync = self._series(
            g, "speedtronic_diloco_seconds_since_last_global_sync"
        ).labels(**ids)
        self.since_sync.set_function(self._seconds_since_sync)

    def watch_membership(self, source: Callable[[], Membership | None]) -> None:
        """Read ``nodes_active`` and each node's last-seen seconds from ``source`` (the
        master's roster: ``(nodes the open round waits for, {peer: seconds})``) at scrape
        time; a source that answers None (not a master) adds nothing."""

        def active() -> float:
            found = source()
            return math.nan if found is None else float(found[0])

        if source() is None:
            return
        self.nodes_active.set_function(active)
        self.registry.register(_LastSeen(self.role, self.node_id, source))

    # -- scrape-time values -------------------------------------------------------------
    def _memory_value(self) -> float:
        device = self._device_memory
        return device if device is not None else _host_rss_bytes()

    def _seconds_since_step(self) -> float:
        last = self._last_step_time
        return self._clock() - (last if last is not None else self._started)

    def _seconds_since_sync(self) -> float:
        last = self._last_sync_time
        return self._clock() - (last if last is not None else self._started)

    @property
    def last_step_time(self) -> float | None:
        """Monotonic time of the last ``train_step`` event, None before the first."""
        return self._last_step_time

    # -- the hook -----------------------------------------------------------------------
    def on_event(self, event: str, payload: JSONView) -> None:
        """Update the series for one logger event; unknown events are ignored."""
        handler = _HANDLERS.get(event)
        if handler is not None:
            with self._lock:
                handler(self, payload)
        elif event in _UPLOAD_EVENTS:
            with self._lock:
                self._on_upload(_UPLOAD_EVENTS[event], payload)

    __call__ = on_event

    def _count_growth(self, attr: str, counter: Counter, value: float | None, fresh: bool) -> None:
        """Increase `counter` by the growth of the cumulative payload value `value`.

        The first value seen counts in full when the run started from step 0 (`fresh`); after
        a resume it only becomes the baseline (the restored total was counted by an earlier
        process).
        """
        if value is None:
            return
        current = int(value)
        previous = getattr(self, attr)
        if previous is None:
            if fresh and current > 0:
                counter.inc(current)
        elif current > previous:
            counter.inc(current - previous)
        setattr(self, attr, current)

    def _on_train_start(self, payload: JSONView) -> None:
        start = _number(payload, "start_step")
        if start is not None:
            self._step = int(start)
            self.step.set(start)

    def _on_train_step(self, payload: JSONView) -> None:
        now = self._clock()
        step = _number(payload, "step")
        fresh = self._step in (None, 0) if self._samples is None else False
        if step is not None:
            previous = self._step
            increment = int(step) - previous if previous is not None else 1
            self.steps.inc(max(increment, 0))
            self._step = int(step)
            self.step.set(step)
        # Cumulative counters restored from a checkpoint count only from this process start.
        self._count_growth("_samples", self.samples, _number(payload, "samples"), fresh)
        self._count_growth("_tokens", self.tokens, _number(payload, "tokens"), fresh)
        for key, gauge in (("loss", self.loss), ("lr", self.learning_rate)):
            value = _number(payload, key)
            if value is not None:
                gauge.set(value)
        rate = _number(payload, "tokens_per_sec")
        if rate is not None:
            self.tokens_per_second.set(rate)
        seconds = _number(payload, "step_time_s")
        if seconds is None and self._last_step_time is not None:
            seconds = now - self._last_step_time
        if seconds is not None and seconds >= 0:
            self.step_seconds.observe(seconds)
        memory = _number(payload, "memory_bytes")
        if memory is not None:
            self._device_memory = memory
        self._last_step_time = now

    def _on_optimizer_step_skipped(self, payload: JSONView) -> None:
        self.skipped_steps.inc()

    def _on_nonfinite_loss(self, payload: JSONView) -> None:
        self.skipped_steps.inc()

    def _on_checkpoint_saved(self, payload: JSONView) -> None:
        self.checkpoint_saves.inc()
        seconds = _number(payload, "seconds")
        if seconds is not None:
            self.checkpoint_seconds.observe(seconds)

    def _on_eval(self, payload: JSONView) -> None:
        loss = _number(payload, "loss")
        scope = str(payload.get("scope") or "local")
        if loss is None or scope not in EVAL_SCOPES:
            return
        self._eval_loss.labels(role=self.role, node_id=self.node_id, scope=scope).set(loss)

    def _on_diloco_started(self, payload: JSONView) -> None:
        step = _number(payload, "global_step")
        if step is not None:
            self.outer_step.set(step)

    def _on_outer_step(self, payload: JSONView) -> None:
        self.rounds.inc()
        step = _number(payload, "outer_step")
        if step is not None:
            self.outer_step.set(step)
        self._count_deltas(payload)
        for gauge, key in (
            (self.round_seconds, "round_seconds"),
            (self.nodes_active, "nodes_active"),
            (self.outer_lr, "eta"),
        ):
            value = _number(payload, key)
            if value is not None:
                gauge.set(value)
        included = _number(payload, "deltas_included")
        if included:
            self._last_sync_time = self._clock()

    def _on_final_global(self, payload: JSONView) -> None:
        self._count_deltas(payload)  # files refused after the last round

    def _count_deltas(self, payload: JSONView) -> None:
        for kind, counter in self.deltas.items():
            value = _number(payload, f"deltas_{kind}")
            if value is not None and value > 0:
                counter.inc(value)

    def _on_sync_wait(self, payload: JSONView) -> None:
        seconds = _number(payload, "seconds")
        if seconds is not None and seconds >= 0:
            self.sync_wait.observe(seconds)
        if payload.get("timed_out") is True:
            self.sync_timeouts.inc()

    def _on_round_done(self, payload: JSONView) -> None:
        utilization = _number(payload, "utilization")
        if utilization is not None and 0.0 <= utilization <= 1.0:
            self.utilization.set(utilization)
        wait = _number(payload, "wait_seconds")
        if wait is not None and math.isfinite(wait) and wait > 0:
            self.exchange_wait.inc(wait)

    def _on_node_dropped(self, payload: JSONView) -> None:
        self.nodes_dropped.inc()

    def _on_global_rejected(self, payload: JSONView) -> None:
        self.globals_rejected.inc()

    def _on_global_pulled(self, payload: JSONView) -> None:
        self.global_pulls.inc()
        step = _number(payload, "outer_step")
        if step is not None:
            self.outer_step.set(step)
        self._last_sync_time = self._clock()

    def _on_transport_retry(self, payload: JSONView) -> None:
        operation = str(payload.get("operation") or "unknown")
        self._retries.labels(role=self.role, node_id=self.node_id, operation=operation).inc()

    def _on_upload(self, result: str, payload: JSONView) -> None:
        self.uploads[result].inc()
        if result != "ok":
            return
        size = _number(payload, "bytes")
        if size is not None and size > 0:
            self.upload_bytes.inc(size)
        seconds = _number(payload, "seconds")
        if seconds is not None and seconds >= 0:
            self.upload_seconds.observe(seconds)
        self._last_sync_time = self._clock()


#: The master's membership: nodes the open round waits for, seconds since each was seen.
Membership = tuple[int, Mapping[str, float]]


class _LastSeen:
    """``speedtronic_diloco_node_last_seen_seconds{peer}``, one sample per node the master's
    roster holds at scrape time (a collector: the set of peers changes with the run)."""

    name = "speedtronic_diloco_node_last_seen_seconds"

    def __init__(self, role: str, node_id: str, source: Callable[[], Membership | None]):
        self.ids, self.source = [role, node_id], source

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, SERIES[self.name], labels=["role", "node_id", "peer"])
        found = self.source()
        for peer, seconds in sorted((found or (0, {}))[1].items()):
            family.add_metric([*self.ids, peer], seconds)
        yield family


_HANDLERS: dict[str, Callable[[PrometheusSink, JSONView], None]] = {
    "train_start": PrometheusSink._on_train_start,
    "train_step": PrometheusSink._on_train_step,
    "optimizer_step_skipped": PrometheusSink._on_optimizer_step_skipped,
    "nonfinite_loss": PrometheusSink._on_nonfinite_loss,
    "checkpoint_saved": PrometheusSink._on_checkpoint_saved,
    "checkpoint": PrometheusSink._on_checkpoint_saved,  # 2.0.0 name of the same event
    "eval": PrometheusSink._on_eval,
    "diloco_started": PrometheusSink._on_diloco_started,
    "outer_step": PrometheusSink._on_outer_step,
    "final_global": PrometheusSink._on_final_global,
    "sync_wait": PrometheusSink._on_sync_wait,
    "round_done": PrometheusSink._on_round_done,
    "node_dropped": PrometheusSink._on_node_dropped,
    "global_rejected": PrometheusSink._on_global_rejected,
    "global_pulled": PrometheusSink._on_global_pulled,
    "transport_retry": PrometheusSink._on_transport_retry,
}
"""The events the sink reads, each with its method (the upload events go through ``_on_upload``)."""
