"""The start-up lines of ``speedtronic train|run`` that say what runs where: the run (model,
data, batch), the devices, and for DiLoCo the exchange with its wire formats both ways.

Each function returns the text of one line; `speedtronic.entrypoint` logs it (with a
structured event under ``logging.format: json``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from speedtronic.config import SpeedtronicConfig

__all__ = ["devices_line", "exchange_line", "run_summary"]


def run_summary(config: SpeedtronicConfig, params: int) -> str:
    """One line on what runs: run, model size (``params``, the model's parameter count),
    data (and ``exchange none`` without DiLoCo; a DiLoCo run's exchange gets its own line,
    `exchange_line`)."""
    shape = config.model
    data = config.data
    if data.text_path or data.token_path or data.dataset:
        source = data.text_path or data.token_path or "dataset"
    else:
        source = f"synthetic {data.synthetic} ({data.num_tokens} samples)"
    exchange = "" if config.distributed.enabled else "; exchange none"  # else its own line
    return (
        f"run {config.run.name}, {config.effective_max_steps} steps; model {shape.name} "
        f"{params:,} parameters ({shape.n_layer} x {shape.d_model}, vocab {shape.vocab_size}, "
        f"context {shape.max_seq_len}); data {source}, batch {data.target_batch_size} x "
        f"{data.block_size} tokens{exchange}"
    )


def devices_line(device: torch.device, precision: str, world: int) -> str:
    """Where this process computes: the ``device`` (its name and memory on CUDA), the
    ``precision`` mode and, for several ranks (``world``), how many."""
    import torch

    where = str(device)
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        where += f" ({props.name}, {props.total_memory / 2**30:.0f} GiB)"
    parts = [where, *([f"precision {precision}"] if precision else [])]
    if world > 1:
        parts.append(f"{world} ranks")
    return ", ".join(parts)


def exchange_line(config: SpeedtronicConfig, role: str, node_id: str) -> str:
    """The DiLoCo exchange in one line: where, as whom, the wire formats both ways, the
    round's shape."""
    dist = config.distributed
    blocks = f" (blocks of {dist.delta_block_size})" if dist.delta_dtype in ("int8", "int4") else ""
    lossy = dist.delta_dtype != "fp32" or dist.global_dtype != "fp32"
    feedback = f", error feedback {'on' if dist.error_feedback else 'off'}" if lossy else ""
    return (
        f"{dist.repo_id} as {role}, node {node_id}; deltas up as {dist.delta_dtype}{blocks}, "
        f"global down as {dist.global_dtype}{feedback}; {dist.inner_steps} inner steps per "
        f"round, sync {dist.sync}"
    )
