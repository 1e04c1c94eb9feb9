"""``speedtronic eval``: find the weights to score, load them into the configured model, score.

Where the weights come from (:func:`load_weights`):

* nothing given: the newest readable checkpoint of ``config.checkpoint_dir`` (a corrupt newest
  file falls back to the previous one, as a resume does);
* ``checkpoint=PATH``: a trainer checkpoint ``.pt`` file; a checkpoint directory (its newest);
  a ``.safetensors`` model state; or a directory holding ``model.safetensors`` and optionally
  ``meta.json`` (``{"outer_step", "step"}``): the layout of the DiLoCo master's ``final/``;
* ``use_global=True``: the DiLoCo global currently published in ``distributed.repo_id`` (a
  new run's global 0, whose weights file follows its record, is waited for, bounded).

``.pt`` files are read with ``torch.load(weights_only=True)``. Every unusable input (nothing to
score, an unreadable file, weights that do not fit ``model``) is a ``CheckpointError`` with one
line naming the path; a config without held-out data is a ``ConfigError``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from speedtronic.checkpoint import CheckpointError, CheckpointManager, check_finite
from speedtronic.config import SpeedtronicConfig
from speedtronic.json_types import JSON, StateDict
from speedtronic.train.evaluate import build_heldout, evaluate

__all__ = ["Weights", "load_model", "load_weights", "score"]

_LOG = logging.getLogger("speedtronic")
#: Seconds between reads of the exchange while a global's weights file is on its way.
_GLOBAL_POLL = 0.5


@dataclass
class Weights:
    """A model state to score and what is known about it (``None`` = unknown); ``evals``: the
    held-out evaluations a trainer checkpoint carries (``None``: the file carries none)."""

    state: dict[str, torch.Tensor]
    source: str
    step: int | None = None
    outer_step: int | None = None
    evals: list[JSON] | None = None


def _int_or_none(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _checkpoint_outer_step(coordinator: object) -> int | None:
    """The outer step a trainer checkpoint's DiLoCo state records (master or node), if any."""
    if not isinstance(coordinator, dict):
        return None
    for value in (
        coordinator.get("outer_step"),
        (coordinator.get("outer") or {}).get("outer_step"),
        (coordinator.get("node") or {}).get("installed"),
    ):
        step = _int_or_none(value)
        if step is not None and step >= 0:
            return step
    return None


def _from_trainer_state(state: StateDict, source: str) -> Weights:
    from speedtronic.train.state import eval_records

    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"checkpoint {source} holds no model state")
    evals = state.get("evals")
    return Weights(
        model,
        source,
        _int_or_none(state.get("step")),
        _checkpoint_outer_step(state.get("coordinator")),
        eval_records(evals.get("records")) if isinstance(evals, dict) else None,
    )


def _latest_in(directory: Path) -> Weights:
    manager = CheckpointManager(directory, warn=lambda message: None)
    state = manager.load_latest()
    if state is None:
        raise CheckpointError(f"no checkpoint in {directory} (train first or pass --checkpoint)")
    return _from_trainer_state(state, str(state.get("path", directory)))


def _from_safetensors(path: Path, meta_path: Path | None = None) -> Weights:
    from safetensors.torch import load_file

    try:
        state = load_file(str(path), device="cpu")
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
    meta: JSON = {}
    if meta_path is not None and meta_path.is_file():
        try:
            loaded = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{meta_path} is not readable JSON: {exc}") from exc
        if isinstance(loaded, dict):
            meta = loaded
    return Weights(
        state, str(path), _int_or_none(meta.get("step")), _int_or_none(meta.get("outer_step"))
    )


def _from_path(path: Path) -> Weights:
    if path.is_dir():
        if (path / "model.safetensors").is_file():
            return _from_safetensors(path / "model.safetensors", path / "meta.json")
        return _latest_in(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        return _from_safetensors(path, path.with_name("meta.json"))
    return _from_trainer_state(CheckpointManager.load(path), str(path))


def _from_global(config: SpeedtronicConfig) -> Weights:
    """The global the exchange's version record names. A new run's global 0 is published as
    its record first and its weights file after it (``exchange.WeightsUpload``): a missing
    weights file is waited for, up to ``distributed.request_timeout`` seconds, saying so once
    (the record is read again meanwhile: a later global may be readable first)."""
    from speedtronic.background import wait_for
    from speedtronic.diloco.coordinator import build_transport
    from speedtronic.diloco.exchange import GlobalMetadata
    from speedtronic.retry import RemoteNotFound

    repo = config.distributed.repo_id
    if not repo:
        raise CheckpointError("--global needs distributed.repo_id (the DiLoCo exchange)")
    missing: list[RemoteNotFound] = []  # the last miss of the weights file, said once

    def read() -> tuple[GlobalMetadata, dict[str, torch.Tensor]] | None:
        meta = transport.global_metadata()
        if meta is None:
            raise CheckpointError(f"no global published in {repo} yet")
        try:
            return meta, dict(transport.read_global(meta))
        except RemoteNotFound as exc:
            if not missing:
                _LOG.warning(
                    f"the weights of global {meta.outer_step} are not in {repo} yet (a new "
                    "run's master sends them after its record); waiting up to "
                    f"{config.distributed.request_timeout:g} s"
                )
            missing[:] = [exc]
            return None

    try:
        transport = build_transport(config.distributed)
        found = wait_for(read, timeout=config.distributed.request_timeout, interval=_GLOBAL_POLL)
        if found is None:
            raise missing[-1]
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read the global from {repo}: {exc}") from exc
    meta, state = found
    return Weights(state, f"global of {repo}", None, meta.outer_step)


def load_weights(
    config: SpeedtronicConfig, *, checkpoint: str | None = None, use_global: bool = False
) -> Weights:
    """The weights ``speedtronic eval`` scores (see the module docstring)."""
    if use_global and checkpoint:
        raise ValueError("pass a checkpoint or use_global, not both")
    if use_global:
        return _from_global(config)
    if checkpoint:
        return _from_path(Path(checkpoint))
    return _latest_in(config.checkpoint_dir)


def score(
    config: SpeedtronicConfig, *, checkpoint: str | None = None, use_global: bool = False
) -> JSON:
    """Score the chosen weights on the held-out set: ``{"loss", "perplexity", "tokens",
    "step", "outer_step", "source"}`` (``None`` where unknown; ``source`` names the file)."""
    from speedtronic.config import ConfigError
    from speedtronic.train.runtime import _device, _precision

    # the weights first: the model a checkpoint's config declares is checked against them
    # before anything of its size (the synthetic held-out chain included) is built
    model, weights = load_model(config, checkpoint=checkpoint, use_global=use_global)
    heldout = build_heldout(config)
    if heldout is None:
        raise ConfigError(
            "eval: no held-out data configured; set eval.holdout (a fraction of the training "
            "data) or eval.text_path / eval.token_path"
        )
    device = _device(config, None)
    model.to(device)
    result = evaluate(model, heldout, device=device, precision=_precision(config, device))
    return {
        **result.as_dict(),
        "step": weights.step,
        "outer_step": weights.outer_step,
        "source": weights.source,
    }


def load_model(
    config: SpeedtronicConfig, *, checkpoint: str | None = None, use_global: bool = False
) -> tuple[torch.nn.Module, Weights]:
    """The configured model (on CPU, eval mode) holding the weights :func:`load_weights` finds.

    Weights that do not fit ``config.model`` (compared before the model is built, so a
    config declaring a larger model than the file holds allocates nothing) or hold NaN/inf
    are a ``CheckpointError`` naming the source. Used by ``speedtronic eval``, ``export``,
    ``sample`` and ``push``.
    """
    from speedtronic.model import build_model
    from speedtronic.model.hf_import import resolve_init_from
    from speedtronic.model.sizes import check_stored

    resolve_init_from(config, weights=False)  # a run started from a transformers checkpoint
    weights = load_weights(config, checkpoint=checkpoint, use_global=use_global)
    shapes = {k: getattr(v, "shape", ()) for k, v in weights.state.items()}
    check_stored(config.model, shapes, weights.source, error=CheckpointError)
    check_finite(weights.state, weights.source)
    model = build_model(config.model)
    try:
        model.load_state_dict(weights.state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:300]
        raise CheckpointError(
            f"{weights.source} does not match the configured model ({config.model.name}): {detail}"
        ) from None
    return model.eval(), weights
