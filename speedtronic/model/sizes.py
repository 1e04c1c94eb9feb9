"""A model's sizes, checked before it is built.

A config declares the shapes (``model.vocab_size``, ``d_model``, ...), and a checkpoint's
config or an ``init_from`` ``config.json`` may declare anything: a 0.8 MB tampered checkpoint
declaring a vocabulary of 2^20 and a width of 8192 used to make ``eval`` allocate 34 GB
before it found that the stored tensors do not fit. Here the model is built on the meta
device (no memory) and its tensors are compared, before the real build:

* with the tensors that will fill it (:func:`check_stored`: a checkpoint's state, or the
  safetensors headers of an ``init_from`` folder, read without their data);
* with the memory this process can have (:func:`check_memory`: the physical memory and the
  cgroup limit; a model whose fp32 weights alone exceed it cannot be built).

Both raise ``ConfigError`` (exit 2) naming the source and the ``model`` fields behind the
shape. Callers: ``build_runtime`` and ``validate`` (the memory; ``init_from``'s headers through
:mod:`speedtronic.model.hf_import`), and ``eval``/``sample``/``export``/``push``
(:func:`speedtronic.train.scoring.load_model`, the stored tensors).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from speedtronic.config import ConfigError, ModelConfig

__all__ = ["check_memory", "check_stored", "memory_limit", "planned_shapes"]

Shape = tuple[int, ...]
_SIZE_FIELDS = ("vocab_size", "d_model", "d_ff")  # those a weight's shape shows as they are


def planned_shapes(section: ModelConfig) -> tuple[dict[str, Shape], int]:
    """``(state-dict name -> shape, bytes)`` of the model ``section`` builds: its state dict
    and, in ``bytes``, every parameter and buffer at its dtype. Built on the meta device."""
    from speedtronic.model.registry import build_model

    with torch.device("meta"):
        model = build_model(section)
    tensors = [*model.parameters(), *model.buffers()]
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}, size


def _limit(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def memory_limit(root: Path = Path("/")) -> int | None:
    """Bytes of memory this process can have: the physical memory, or less when its cgroup
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) sets less; None when unknown."""
    found: list[int] = []
    with contextlib.suppress(ValueError, OSError):  # a platform without these names
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        lines = (root / "proc/self/cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        lines = []
    cgroups = root / "sys/fs/cgroup"
    for line in lines:
        number, controllers, path = [*line.split(":", 2), "", ""][:3]
        relative = path.lstrip("/")
        if number == "0" and controllers == "":
            folders, name = [cgroups / relative, cgroups], "memory.max"
        elif "memory" in controllers.split(","):
            folders, name = (
                [cgroups / "memory" / relative, cgroups / "memory"],
                "memory.limit_in_bytes",
            )
        else:
            continue
        found += [n for n in (_limit(folder / name) for folder in folders) if n is not None]
    return min(found) if found else None


def _fields(section: ModelConfig, expected: Shape, stored: Shape = ()) -> str:
    """The size fields whose values make ``expected`` and are not in ``stored``."""
    named = [
        f"model.{name} {getattr(section, name)}"
        for name in _SIZE_FIELDS
        if getattr(section, name) in expected and getattr(section, name) not in stored
    ]
    return ", ".join(named) or "model.n_head, n_kv_head and d_ff"


def _size(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 10**8 else f"{count / 1e6:.1f} MB"


def check_memory(section: ModelConfig, source: str, limit: int | None = None) -> int:
    """Refuse a model whose weights exceed ``limit`` bytes (default: :func:`memory_limit`)
    before it is built; returns its size in bytes. ``source``: where the sizes came from."""
    shapes, size = planned_shapes(section)
    limit = memory_limit() if limit is None else limit
    if limit is not None and size > limit:
        largest = max(shapes.values(), key=lambda shape: torch.Size(shape).numel())
        raise ConfigError(
            f"model: {source} declares a model of {_size(size)} ({_fields(section, largest)}, "
            f"model.n_layer {section.n_layer}), more than the {_size(limit)} of memory this "
            "process can have; it is not built"
        )
    return size


def check_stored(
    section: ModelConfig,
    stored: Mapping[str, Sequence[int]],
    source: str,
    error: type[Exception] = ConfigError,
) -> None:
    """Refuse (``error``, naming ``source`` and the ``model`` fields) tensors ``stored``
    (state-dict name -> shape) that do not fit the model ``section`` declares, before it is
    built: a name it lacks or does not have, or another shape."""
    shapes, _ = planned_shapes(section)
    missing = sorted(set(shapes) - set(stored))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise error(
            f"{source} does not match the configured model: it lacks {missing[0]}{more}, which "
            f"model.n_layer {section.n_layer} and model.tie_weights {section.tie_weights} declare"
        )
    extra = sorted(set(stored) - set(shapes))
    if extra:
        raise error(
            f"{source} does not match the configured model: it holds {extra[0]}, which "
            f"model.n_layer {section.n_layer} and model.tie_weights {section.tie_weights} have "
            "no place for"
        )
    for name, expected in shapes.items():
        found = tuple(int(n) for n in stored[name])
        if found != expected:
            raise error(
                f"{source} does not match the configured model: {name} is stored as {found}, "
                f"but {_fields(section, expected, found)} make it {expected}"
            )
