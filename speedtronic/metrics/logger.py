"""``MetricLogger``: the one sink every event goes through (text, JSONL, hooks).

``emit(event, payload)`` fans one event out, under a re-entrant lock so the trainer, the
DiLoCo outer thread and the uploader can emit concurrently:

1. text: one short line ``<event> key=value ...`` to stdout (or ``logging.file``) with the
   fields a person watches (`speedtronic.metrics.lines`: a ``train_step`` line holds step,
   loss, lr, tok/s, the newest eval loss and the outer step; never a None), or, with
   ``logging.format: json``, one JSON object per line with every field
   (``{"ts", "level", "logger", "event", "fields"}``; plain messages carry ``message``);
2. JSONL (``logging.json_file``): ``{"event": <name>, **payload, "run_id": <id>}`` per line;
   the run id (`new_run_id`, one per logger, so one per process run) tells the runs that
   share a file apart (``speedtronic plot`` draws the last one);
3. hooks, in order: objects with ``on_event(event, payload)`` or plain callables
   ``(event, payload)``. A failing hook is logged as a warning; training continues.

``train_step`` events follow the ``every_steps`` cadence for text, JSONL and hooks, except for
hooks that set ``wants_all_steps = True`` (the Prometheus exporter, progress bars): they get
every step. Secrets passed as ``secrets=`` (the Hub token) are replaced by ``<redacted>`` in
every text line, JSONL record and exception message this logger writes.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import secrets as _secrets
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, runtime_checkable

from speedtronic.config.redaction import REDACTED, scrub
from speedtronic.json_types import JSON
from speedtronic.metrics.hooks import Hook, call, wants_all_steps
from speedtronic.metrics.lines import TextLines

if TYPE_CHECKING:
    import torch

__all__ = [
    "REDACTED",
    "EventLog",
    "JsonLogFormatter",
    "MetricLogger",
    "RedactingFilter",
    "TextLog",
    "memory_usage_bytes",
    "new_run_id",
]


class TextSink(Protocol):
    """Where text lines go: a file-like object, or the progress bar's ``TqdmStream``."""

    def write(self, text: str, /) -> int:
        """Write ``text``; the number of characters taken."""

    def flush(self) -> None:
        """Push out what was written."""


class TextLog(Protocol):
    """A logger of plain lines: ``MetricLogger``, ``logging.Logger`` or a stand-in."""

    def info(self, message: str, /, *args: object) -> None:
        """Log at INFO."""

    def warning(self, message: str, /, *args: object) -> None:
        """Log at WARNING."""


@runtime_checkable
class EventLog(Protocol):
    """What a component that warns and reports events needs (``MetricLogger`` is one)."""

    def warning(self, message: str, *args: object) -> None:
        """Log a warning."""

    def emit(self, event: str, payload: JSON | None = None) -> None:
        """Report one structured event."""


def memory_usage_bytes(device: torch.device | str | int | None = None) -> int | None:
    """Allocated accelerator memory in bytes for ``device`` (CUDA or MPS), else ``None``.

    A CPU device (or no accelerator) gives ``None``; no query ever synchronises the device.
    """
    try:
        import torch

        kind = device.type if isinstance(device, torch.device) else device
        if kind in (None, "cuda") and torch.cuda.is_available():
            return int(torch.cuda.memory_allocated(device))
        if kind in (None, "mps") and torch.backends.mps.is_available():
            return int(torch.mps.current_allocated_memory())
    except Exception:
        return None
    return None


def new_run_id() -> str:
    """A fresh run id: the UTC start time and 6 random hex digits, ``20261203T160512Z-3f9a1c``
    (sorts by start time; unique across processes started in the same second)."""
    stamp = _dt.datetime.now(tz=_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{_secrets.token_hex(3)}"


class JsonLogFormatter(logging.Formatter):
    """The one JSON log line format (``logging.format: json``), for the MetricLogger and the
    process log of ``speedtronic train|run`` alike: ``{"ts", "level", "logger"}``, then
    ``"event"`` and ``"fields"`` for records logged with ``extra={"st_event": name,
    "st_fields": {...}}``, ``"message"`` (for an event record only with ``event_messages``),
    and ``"exception"`` when the record has one.

    ``logger_name`` replaces the record's logger name (the MetricLogger writes as
    ``speedtronic``, and leaves ``event_messages`` off: its event text restates the fields);
    ``ts`` is UTC with milliseconds and a ``Z`` suffix.
    """

    def __init__(self, logger_name: str | None = None, *, event_messages: bool = True) -> None:
        super().__init__()
        self.logger_name = logger_name
        self.event_messages = event_messages

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as a single-line JSON object."""
        stamp = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
        line: JSON = {
            "ts": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": self.logger_name or record.name,
        }
        extra = vars(record)  # ``extra=`` fields are the record's own attributes
        event = extra.get("st_event")
        if event is None or self.event_messages:
            line["message"] = record.getMessage()
        if event is not None:
            line["event"] = event
            line["fields"] = extra.get("st_fields", {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class RedactingFilter(logging.Filter):
    """Replaces every secret in a record's rendered message with ``<redacted>``."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            record.msg, record.args = _redact_text(record.getMessage(), self.secrets), None
            fields = vars(record).get("st_fields")
            if fields is not None:
                try:
                    record.st_fields = json.loads(
                        _redact_text(json.dumps(fields, default=str), self.secrets)
                    )
                except ValueError:  # a redaction that cut through an escape sequence
                    record.st_fields = {"fields": REDACTED}
        return True


def _redact_text(text: str, secrets: Iterable[str]) -> str:
    """Every form of every secret (raw, stripped, escaped, encoded) and any token-shaped
    string replaced by ``<redacted>``."""
    return scrub(text, secrets)


class MetricLogger:
    """Text + JSONL + hook fan-out for training events.

    Args:
        level: text log level name (``INFO``, ``WARNING``...); JSONL and hooks ignore it.
        file: text log file instead of the stream (parent directories created).
        json_file: JSONL event file (parent directories created; appended to).
        every_steps: cadence for ``train_step`` events (other events are never filtered).
        stream: text stream when ``file`` is not set (default ``sys.stdout``).
        hooks: initial hook list; ``logger.hooks`` is public, append to attach more.
        format: ``"text"`` (``asctime | LEVEL | message``) or ``"json"`` (one object per line).
        secrets: strings (the Hub token) that must never appear in any output.
        run_id: the ``run_id`` of every JSONL record (default: a new `new_run_id`).
    """

    def __init__(
        self,
        level: str = "INFO",
        file: str | Path | None = None,
        json_file: str | Path | None = None,
        every_steps: int = 1,
        stream: IO[str] | None = None,
        hooks: list[Hook] | None = None,
        format: str = "text",
        secrets: Iterable[str | None] = (),
        run_id: str | None = None,
    ) -> None:
        if int(every_steps) <= 0:
            raise ValueError("logging.every_steps must be positive")
        if format not in {"text", "json"}:
            raise ValueError(f"logging.format: expected 'text' or 'json', got {format!r}")
        self.level = str(level).upper()
        self.file = Path(file) if file else None
        self.json_file = Path(json_file) if json_file else None
        self.every_steps = int(every_steps)
        self.format = format
        self.hooks: list[Hook] = list(hooks) if hooks else []
        self.secrets = [s for s in secrets if s]
        self.run_id = run_id or new_run_id()
        self.text_steps = True  # False: train_step events skip the text sink (progress bar on)
        self.started = time.perf_counter()
        self._lines = TextLines()
        self._lock = threading.RLock()
        self._json_handle: IO[str] | None = None
        self._logger = logging.getLogger(f"speedtronic.metrics.{id(self)}")
        number: object = logging.getLevelName(self.level)  # a known name gives its number
        self._logger.setLevel(number if isinstance(number, int) else logging.INFO)
        self._logger.propagate = False
        if self.file is not None:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            handler: logging.Handler = logging.FileHandler(self.file, encoding="utf-8")
        else:
            handler = logging.StreamHandler(stream or sys.stdout)
        if format == "json":
            handler.setFormatter(JsonLogFormatter("speedtronic", event_messages=False))
        else:
            handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(message)s"))
        handler.addFilter(RedactingFilter(self.secrets))
        self._handler = handler
        self._logger.addHandler(handler)
        if self.json_file is not None:
            self.json_file.parent.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ events

    def wants_step(self, step: int) -> bool:
        """Whether a ``train_step`` at ``step`` passes the cadence filter."""
        return self.every_steps <= 1 or step % self.every_steps == 0

    def emit(self, event: str, payload: JSON | None = None) -> None:
        """Send one event to text, JSONL and hooks (see the module docstring)."""
        with self._lock:
            safe = dict(payload or {})
            if self.secrets:
                safe = {
                    key: _redact_text(value, self.secrets) if isinstance(value, str) else value
                    for key, value in safe.items()
                }
            own_elapsed = "elapsed_s" in safe
            safe.setdefault("elapsed_s", time.perf_counter() - self.started)
            in_cadence = event != "train_step" or self.wants_step(int(safe.get("step", 0)))
            if in_cadence:
                if self.text_steps or event != "train_step":
                    self._write_text(event, safe, own_elapsed)
                self._write_jsonl(event, safe)
            for hook in list(self.hooks):
                if not in_cadence and not wants_all_steps(hook):
                    continue
                try:
                    call(hook, event, safe)
                except Exception as exc:
                    self.warning("metric hook failed: %s", exc)

    def _write_text(self, event: str, payload: JSON, own_elapsed: bool) -> None:
        text = self._lines.render(event, payload, own_elapsed=own_elapsed)  # remembers too
        if not self._logger.isEnabledFor(logging.INFO):
            return
        self._logger.info("%s", text, extra={"st_event": event, "st_fields": payload})

    def _write_jsonl(self, event: str, payload: JSON) -> None:
        if self.json_file is None:
            return
        line = json.dumps({"event": event, **payload, "run_id": self.run_id}, default=str)
        if self.secrets:
            line = _redact_text(line, self.secrets)
        if self._json_handle is None:
            self._json_handle = open(self.json_file, "a", encoding="utf-8")  # noqa: SIM115
        self._json_handle.write(line + "\n")
        self._json_handle.flush()

    # ------------------------------------------------------------------ plain messages

    def log(self, level: int, message: str, *args: object) -> None:
        """Log a plain message (``%``-style ``args``) to the text sink."""
        with self._lock:
            self._logger.log(level, message, *args)

    def debug(self, message: str, *args: object) -> None:
        """Log at DEBUG."""
        self.log(logging.DEBUG, message, *args)

    def info(self, message: str, *args: object) -> None:
        """Log at INFO."""
        self.log(logging.INFO, message, *args)

    def warning(self, message: str, *args: object) -> None:
        """Log at WARNING."""
        self.log(logging.WARNING, message, *args)

    def error(self, message: str, *args: object) -> None:
        """Log at ERROR."""
        self.log(logging.ERROR, message, *args)

    def redact(self, text: str) -> str:
        """``text`` with every configured secret replaced by ``<redacted>``."""
        return _redact_text(text, self.secrets)

    def set_stream(self, stream: TextSink) -> None:
        """Send text lines to ``stream`` (no-op when logging to a file)."""
        if isinstance(self._handler, logging.StreamHandler) and self.file is None:
            with self._lock:
                self._handler.setStream(stream)

    def close(self) -> None:
        """Flush and close the text file and JSONL handles (hooks are not closed)."""
        with self._lock:
            if self._json_handle is not None:
                self._json_handle.close()
                self._json_handle = None
            if self._handler in self._logger.handlers:
                self._handler.flush()
                self._handler.close()
                self._logger.removeHandler(self._handler)
