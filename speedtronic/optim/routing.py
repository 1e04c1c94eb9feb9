"""Parameter routing: which trainable tensor goes to Muon and which to AdamW.

Muon (Keller Jordan, 2024) is meant for the *hidden* 2-D weight matrices of a network. Embeddings,
the output head, norm gains, biases and every non-matrix tensor are better served by AdamW. This
module makes that split once, by name and module type, so that every trainable parameter lands in
exactly one group (tied tensors are routed once).

A module can override the heuristic by setting ``_speedtronic_optimizer_role`` to ``"muon"`` or
``"adamw"``. ``"muon"`` still falls back to AdamW for biases, non-2-D and non-floating tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

ROLE_ATTRIBUTE = "_speedtronic_optimizer_role"
"""Module attribute that overrides routing: ``"muon"``, ``"adamw"`` or ``None``."""

# Exact dotted-name components that mark an embedding or an output head (reference/v2.md §2).
EMBEDDING_OR_HEAD_COMPONENTS = frozenset(
    {
        "embed",
        "embedding",
        "wte",
        "wpe",
        "lm_head",
        "classifier",
        "output",
        "output_proj",
        "score",
        "score_proj",
        "head",
    }
)

NamedParameter = tuple[str, nn.Parameter]


@dataclass
class ParameterRouting:
    """Result of :func:`route_parameters`: ``(qualified_name, parameter)`` pairs per destination.

    ``skipped`` holds frozen parameters (``requires_grad=False``), which no optimizer receives.
    """

    muon: list[NamedParameter] = field(default_factory=list)
    adamw: list[NamedParameter] = field(default_factory=list)
    skipped: list[NamedParameter] = field(default_factory=list)

    @property
    def muon_params(self) -> list[nn.Parameter]:
        """Parameters routed to Muon, in model order."""
        return [param for _, param in self.muon]

    @property
    def adamw_params(self) -> list[nn.Parameter]:
        """Parameters routed to AdamW, in model order."""
        return [param for _, param in self.adamw]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Unique (by identity) parameters with ``requires_grad``, in ``named_parameters`` order."""
    seen: set[int] = set()
    result: list[nn.Parameter] = []
    for _, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        result.append(param)
    return result


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module, str]]:
    """Map tensor identity -> (owner qualified name, owner module, local name); first owner wins."""
    owners: dict[int, tuple[str, nn.Module, str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), (module_name, module, local_name))
    return owners


def _is_embedding_or_head(owner_name: str, owner: nn.Module) -> bool:
    class_name = type(owner).__name__.lower()
    if "embedding" in class_name or "norm" in class_name:
        return True
    components = [part for part in owner_name.split(".") if part]
    return any(part in EMBEDDING_OR_HEAD_COMPONENTS for part in components)


def _is_matrix(param: torch.Tensor, local_name: str) -> bool:
    return param.ndim == 2 and param.is_floating_point() and not local_name.endswith("bias")


def _route_one(owner_name: str, owner: nn.Module, local_name: str, param: torch.Tensor) -> str:
    role = getattr(owner, ROLE_ATTRIBUTE, None)
    if role not in (None, "muon", "adamw"):
        raise ValueError(
            f"module {owner_name or '<root>'!r} has invalid {ROLE_ATTRIBUTE}={role!r}; "
            "expected 'muon', 'adamw' or None"
        )
    if role == "adamw":
        return "adamw"
    if role == "muon":
        return "muon" if _is_matrix(param, local_name) else "adamw"
    if not isinstance(owner, nn.Linear) or not _is_matrix(param, local_name):
        return "adamw"
    return "adamw" if _is_embedding_or_head(owner_name, owner) else "muon"


def route_parameters(model: nn.Module) -> ParameterRouting:
    """Split ``model``'s parameters into Muon, AdamW and skipped lists (reference/v2.md §2).

    Hidden 2-D ``nn.Linear`` weights go to Muon; embeddings, heads (by component name), norms,
    biases, non-2-D and non-``nn.Linear`` tensors go to AdamW; frozen tensors are skipped. Tied
    tensors appear once, under the first owning module in ``named_modules`` order. Raises
    ``ValueError`` for an invalid ``_speedtronic_optimizer_role`` value.
    """
    owners = _owners(model)
    routing = ParameterRouting()
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if not param.requires_grad:
            routing.skipped.append((name, param))
            continue
        owner_name, owner, local_name = owners.get(id(param), ("", model, name))
        destination = _route_one(owner_name, owner, local_name, param)
        (routing.muon if destination == "muon" else routing.adamw).append((name, param))
    return routing


def assert_exactly_once(model: nn.Module, groups: Iterable[Iterable[torch.Tensor]]) -> None:
    """Assert every trainable parameter of ``model`` is in exactly one of ``groups``.

    An internal invariant of the optimizer builders (a failure is a bug, not a user error).
    """
    counts: dict[int, int] = {}
    for group in groups:
        for param in group:
            counts[id(param)] = counts.get(id(param), 0) + 1
    expected = {id(param) for param in trainable_parameters(model)}
    assert set(counts) == expected, "optimizer groups do not cover the trainable parameters"
    assert all(count == 1 for count in counts.values()), "a parameter is in more than one group"
