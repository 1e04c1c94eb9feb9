"""Out-of-order backprop: run forward stages on side CUDA streams so backward kernels overlap.

Not a custom backward engine. Autograd runs each backward op on the stream its forward op ran on
and synchronises streams along gradient edges itself, so placing the *forward* of independent
module "stages" on side streams lets their backward kernels overlap. The maths is unchanged.

How the trainer uses it (``config.ooo_backprop`` true and ``torch.compile`` not active)::

    from speedtronic.train.ooo import StageStreamScheduler

    scheduler = StageStreamScheduler(model, device, num_streams=config.ooo_streams,
                                     logger=logger)          # never raises
    logger.emit("ooo_backprop", scheduler.as_dict())          # {"enabled", "reason", ...}
    try:
        for micro_batch in ...:
            scheduler.begin()                 # before the forward, inside autocast
            try:
                loss = model(**batch)["loss"]
            finally:
                scheduler.finish()            # ambient stream waits for every side stream
            loss.backward()                   # backward/step as usual, outside begin/finish
    finally:
        scheduler.dispose()                   # remove hooks; create a new one per fit()

With compile active, skip the scheduler and emit ``{"enabled": False, "reason": "compile is
enabled"}`` (or use ``StageStreamScheduler.disabled("compile is enabled")``, a null object).
On CPU/MPS, without CUDA, with fewer than two stages, or with invalid ``ooo_stage_names``
(duplicate or nested) the scheduler is disabled with a ``reason`` and every method is a no-op.

Stages: the model's ``ooo_stage_names`` (unique, not nested; unknown names ignored) or every leaf
module. Stage ``i`` runs on side stream ``i mod k`` with ``k = min(num_streams, stages)``.
Synchronisation (correctness first): on entering a stage its stream waits on the ambient stream
(so every input produced there, hooked or not, is ready) and on the recorded producer stream of
each input; on leaving, the ambient stream waits on the stage stream. Tensors crossing streams
get ``record_stream`` so the caching allocator does not reuse their memory early.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from speedtronic.json_types import JSON

if TYPE_CHECKING:
    from speedtronic.metrics.logger import EventLog

__all__ = ["StageInfo", "StageStreamScheduler", "select_stages"]

MAX_STREAMS = 8

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageInfo:
    """A stage: the module's qualified name and the index of its side stream."""

    name: str
    stream_index: int


def select_stages(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stages of ``model``: its valid ``ooo_stage_names``, else every leaf module.

    Raises ``ValueError`` when ``ooo_stage_names`` repeats a name or names nested modules
    (``a`` and ``a.b``). Unknown names and the root are ignored; leaves are de-duplicated by
    identity, depth-first in ``named_children`` order.
    """
    names = getattr(model, "ooo_stage_names", None)
    if names:
        requested = [str(name) for name in names]
        duplicates = sorted({name for name in requested if requested.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate ooo_stage_names: {duplicates}")
        for outer in requested:
            for inner in requested:
                if inner != outer and inner.startswith(outer + "."):
                    raise ValueError(f"nested ooo_stage_names: {outer!r} contains {inner!r}")
        modules = dict(model.named_modules())
        chosen = [(name, modules[name]) for name in requested if name and name in modules]
        if chosen:
            return chosen
    stages: list[tuple[str, nn.Module]] = []
    seen: set[int] = {id(model)}
    for name, module in _leaves(model, ""):
        if id(module) not in seen:
            seen.add(id(module))
            stages.append((name, module))
    return stages


def _leaves(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        if any(True for _ in child.children()):
            yield from _leaves(child, qualified)
        else:
            yield qualified, child


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples/lists/dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class StageStreamScheduler:
    """Places stage forwards on side CUDA streams (see the module docstring for the contract).

    Attributes: ``enabled``, ``reason`` (why disabled, else ``None``), ``stages``
    (``StageInfo`` list), ``requested_streams`` (``num_streams`` clamped to 1..8).
    Construction never raises: setup problems disable the scheduler with a reason.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        *,
        num_streams: int = 4,
        logger: EventLog | logging.Logger | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.logger = logger
        self.requested_streams = max(1, min(MAX_STREAMS, int(num_streams)))
        self.enabled = False
        self.reason: str | None = None
        self.stages: list[StageInfo] = []
        self._streams: list[torch.cuda.Stream] = []
        self._handles: list[RemovableHandle] = []
        self._ambient: torch.cuda.Stream  # the current stream, set by begin()
        self._active = False
        self._producers: dict[int, torch.cuda.Stream] = {}
        self._contexts: list[torch.cuda.StreamContext] = []
        self._setup()

    @classmethod
    def disabled(cls, reason: str) -> StageStreamScheduler:
        """A no-op scheduler reporting ``reason`` (e.g. ``"compile is enabled"``)."""
        scheduler = cls(nn.Module(), "cpu")
        scheduler.reason = reason
        return scheduler

    # -------------------------------------------------------------- setup

    def _disable(self, reason: str) -> None:
        self.enabled, self.reason = False, reason

    def _setup(self) -> None:
        if self.device.type != "cuda":
            self._disable(f"device {self.device.type} has no supported CUDA stream scheduler")
            return
        try:
            stages = select_stages(self.model)
            if len(stages) < 2:
                self._disable("fewer than two independent stages were found")
                return
            if not torch.cuda.is_available():
                self._disable("CUDA is unavailable")
                return
            count = min(self.requested_streams, len(stages))
            with torch.cuda.device(self.device):
                self._streams = [
                    torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # torch: unannotated __new__
                    for _ in range(count)
                ]
            for index, (name, module) in enumerate(stages):
                stream = self._streams[index % count]
                self._handles.append(
                    module.register_forward_pre_hook(self._pre_hook(stream), with_kwargs=True)
                )
                self._handles.append(module.register_forward_hook(self._post_hook(stream)))
                self.stages.append(StageInfo(name, index % count))
            self.enabled, self.reason = True, None
        except Exception as exc:  # degrade, never crash the run
            self._remove_hooks()
            self._streams, self.stages = [], []
            self._disable(f"stream scheduling setup failed: {exc}")
            self._report_failure()

    def _report_failure(self) -> None:
        message = f"ooo_backprop disabled: {self.reason}"
        (self.logger or _log).warning(message)

    # -------------------------------------------------------------- hooks

    def _pre_hook(
        self, stream: torch.cuda.Stream
    ) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
        def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            if not self._active:
                return None
            stream.wait_stream(self._ambient)
            for tensor in _tensors((args, kwargs)):
                producer = self._producers.get(id(tensor))
                if producer is not None and producer != stream:
                    stream.wait_stream(producer)
                if tensor.is_cuda:
                    tensor.record_stream(stream)
            context = torch.cuda.stream(stream)
            context.__enter__()  # type: ignore[no-untyped-call]  # torch: StreamContext unannotated
            self._contexts.append(context)
            return None

        return hook

    def _post_hook(
        self, stream: torch.cuda.Stream
    ) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if not self._active or not self._contexts:
                return None
            self._contexts.pop().__exit__(None, None, None)
            self._ambient.wait_stream(stream)
            for tensor in _tensors(output):
                self._producers[id(tensor)] = stream
                if tensor.is_cuda:
                    tensor.record_stream(self._ambient)
            return None

        return hook

    # -------------------------------------------------------------- trainer API

    def begin(self) -> None:
        """Start a micro-batch forward: side streams wait on the current (ambient) stream."""
        if not self.enabled:
            return
        self._ambient = torch.cuda.current_stream(self.device)
        self._producers.clear()
        for stream in self._streams:
            stream.wait_stream(self._ambient)
        self._active = True

    def finish(self) -> None:
        """End the forward: the ambient stream waits on every side stream. Safe to repeat."""
        if not self.enabled or not self._active:
            return
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        for stream in self._streams:
            self._ambient.wait_stream(stream)
        self._producers.clear()
        self._active = False

    def dispose(self) -> None:
        """Finish, remove every hook and disable. Safe to call more than once."""
        self.finish()
        self._remove_hooks()
        if self.enabled:
            self._disable("disposed")

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def as_dict(self) -> JSON:
        """``{"enabled", "reason", "streams", "stages"}`` for the ``ooo_backprop`` event."""
        return {
            "enabled": self.enabled,
            "reason": self.reason,
            "streams": len(self._streams),
            "stages": [stage.name for stage in self.stages],
        }
