"""The dry run of a training run: what ``speedtronic validate`` checks before anything trains.

`preflight` opens everything `speedtronic.train.runtime.build_runtime` opens before the first
step, with the same code, and stops there: the device and precision (``run.device`` on this
machine), the model (built on the meta device, so no weights are allocated; its size against
the memory, and ``init_from``'s weight headers against its ``config.json``), the tokenizer, the
training source (``data.text_path``, ``data.token_path``, ``data.dataset``: files opened,
prepared folders matched to the tokenizer, token ids checked against ``model.vocab_size``), the
held-out set (``eval.text_path``, ``eval.token_path``, ``eval.holdout``), and, when the run
resumes, the checkpoint it would resume from. Every problem is the ``ConfigError`` the run would
raise (exit 2 in the CLI). The warnings and notes the run logs at start come from the functions
the run calls (`speedtronic.config.schema.config_warnings`, the runtime's data lines, the shape
check), collected instead of logged. Nothing is written, nothing is trained, no network call is
made beyond a Hub tokenizer id (as the run would).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from speedtronic.config import SpeedtronicConfig
from speedtronic.config.schema import config_warnings
from speedtronic.json_types import JSON

if TYPE_CHECKING:
    from torch.utils.data import Dataset

__all__ = ["Preflight", "preflight"]


@dataclass
class Preflight:
    """What a run of the config would open and say at start.

    ``parameters``: the model's parameter count (shared tensors once); ``steps``: the run
    target; ``data`` and ``exchange``: one phrase each; ``files``: ``(field, path)`` of every
    file or folder opened; ``notes``: the run's informational start-up lines; ``warnings``:
    its start-up warnings; ``resume_from``: the checkpoint a resume would load (None when the
    run does not resume or finds none).
    """

    parameters: int
    steps: int
    data: str
    exchange: str
    files: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    resume_from: str | None = None

    def verdict(self) -> str:
        """``config OK: <parameters>, <steps>, <data>, <exchange>`` (+ the warning count)."""
        line = (
            f"config OK: {self.parameters:,} parameters, {self.steps} steps, "
            f"data {self.data}, exchange {self.exchange}"
        )
        count = len(self.warnings)
        return line + (f"; {count} warning{'s' if count > 1 else ''}" if count else "")

    def as_dict(self) -> JSON:
        """JSON-ready form (``files`` as ``{"field", "path"}`` objects)."""
        return {
            "ok": True,
            "parameters": self.parameters,
            "steps": self.steps,
            "data": self.data,
            "exchange": self.exchange,
            "files": [{"field": name, "path": path} for name, path in self.files],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "resume_from": self.resume_from,
        }


class _Collector:
    """Stands in for the run's logger: keeps each line instead of logging it."""

    def __init__(self, report: Preflight) -> None:
        self.report = report

    def info(self, message: str, *args: object) -> None:
        self.report.notes.append(message % args if args else message)

    def warning(self, message: str, *args: object) -> None:
        self.report.warnings.append(message % args if args else message)


def _files(config: SpeedtronicConfig) -> list[tuple[str, str]]:
    """``(field, path)`` of every file or folder the run reads before it trains (the training
    source by precedence: text_path > token_path > dataset; a Hub tokenizer id is marked)."""
    from speedtronic.config.tokenizer_file import is_bytes

    data, held = config.data, config.eval
    dataset = data.dataset if isinstance(data.dataset, (str, os.PathLike)) else None
    if data.text_path:
        source = ("data.text_path", data.text_path)
    elif data.token_path:
        source = ("data.token_path", data.token_path)
    else:
        source = ("data.dataset", dataset)
    named = [
        source,
        ("data.tokenizer", None if is_bytes(data.tokenizer) else data.tokenizer),
        ("eval.text_path", held.text_path),
        ("eval.token_path", held.token_path),
    ]
    found = []
    for name, value in named:
        if value is None:
            continue
        path = os.fspath(value)
        if name == "data.tokenizer" and not os.path.exists(path):
            path += " (Hub)"
        found.append((name, path))
    return found


def _describe_data(config: SpeedtronicConfig, dataset: Dataset[object]) -> str:
    """One phrase for the training source, as the run's start-up summary says it."""
    data = config.data
    from speedtronic.data.datasets import TokenWindowDataset

    size = dataset.num_tokens if isinstance(dataset, TokenWindowDataset) else None
    tokens = f" ({size:,} tokens)" if size is not None else ""
    if data.text_path:
        return f"{data.text_path}"
    if data.token_path:
        return f"{data.token_path}{tokens}"
    if data.dataset is not None:
        count = len(dataset) if hasattr(dataset, "__len__") else None
        return f"dataset {data.dataset}" + (f" ({count:,} samples)" if count is not None else "")
    return f"synthetic {data.synthetic} ({data.num_tokens} samples)"


def _describe_exchange(config: SpeedtronicConfig) -> str:
    """``none``, or where the DiLoCo exchange is, this process's role and the wire formats."""
    section = config.distributed
    if not section.enabled:
        return "none"
    return (
        f"{section.repo_id} ({section.role}, {section.delta_dtype} deltas, "
        f"{section.global_dtype} global, {section.inner_steps} inner steps)"
    )


def _resume_from(config: SpeedtronicConfig, report: Preflight) -> None:
    """The checkpoint a resume would start from (the newest by recorded step), or the warning
    the run logs when there is none."""
    from speedtronic.checkpoint import CheckpointManager

    section = config.checkpoint
    manager = CheckpointManager(config.checkpoint_dir, keep_last=section.keep_last)
    latest = manager.latest_path()
    if latest is None:
        report.warnings.append("resume requested but no local checkpoint was found")
        return
    report.resume_from = str(latest)


def preflight(config: SpeedtronicConfig, *, resume: bool = False) -> Preflight:
    """Open what a run of ``config`` opens before its first step and report it (see above).

    ``resume``: the run's ``--resume`` (OR-ed with ``checkpoint.resume``). Raises the
    ``ConfigError`` the run would raise, naming the field.
    """
    from speedtronic.data import build_node_dataloader
    from speedtronic.model import build_model
    from speedtronic.model.hf_import import resolve_init_from
    from speedtronic.model.sizes import check_memory
    from speedtronic.train.evaluate import build_heldout
    from speedtronic.train.runtime import _device, _log_data, _precision
    from speedtronic.train.shapes import validate_startup_shapes

    config = config.validate()
    resolve_init_from(config, weights=False)  # model.init_from's shape and tokenizer
    from speedtronic.checkpoint import CheckpointManager

    CheckpointManager(config.checkpoint_dir).claim(  # one run per folder, as train refuses
        resume=resume or config.checkpoint.resume,
        overwrite=config.checkpoint.overwrite,
        clear=False,  # a dry run deletes nothing
    )
    device = _device(config, None)
    precision = _precision(config, device)
    spec = config.model.init_from  # as the run does before it builds the model:
    check_memory(config.model, f"model.init_from {spec}" if spec else "the config")
    with torch.device("meta"):
        model = build_model(config.model)
    report = Preflight(
        parameters=sum(p.numel() for p in model.parameters()),
        steps=config.effective_max_steps,
        data="",
        exchange=_describe_exchange(config),
        files=_files(config),
    )
    collector = _Collector(report)
    loader = build_node_dataloader(config, None)
    heldout = build_heldout(config)
    report.data = _describe_data(config, loader.dataset)
    _log_data(collector, loader, heldout)
    validate_startup_shapes(config, model, device, precision, logger=collector)
    report.warnings.extend(config_warnings(config))
    if resume or config.checkpoint.resume:
        _resume_from(config, report)
    return report
