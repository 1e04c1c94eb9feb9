"""``speedtronic push``: a checkpoint as a Hugging Face Hub model repo, with its model card.

::

    result = push_model(config, repo_id="owner/name", checkpoint="runs/x/checkpoints/...")

The weights are exported exactly as ``speedtronic export --format hf`` writes them
(:func:`speedtronic.model.export.export_hf`: ``config.json``, ``model.safetensors``, the tokenizer
files, ``speedtronic.json``), plus ``generation_config.json`` and a ``README.md`` model card
(:func:`model_card`): architecture and size, steps and tokens trained, the held-out loss
history of the run (final and best, from its JSONL events), the DiLoCo setup, the redacted
training config and the software versions. The repo is created when missing
(``private=True`` makes it private) and everything goes up in **one commit** through
huggingface_hub's public ``HfApi.create_commit``, under the run's retry policy
(``distributed.retry_*``; 429 honours ``Retry-After``). The token comes from the usual layers
(``HF_TOKEN``, the ``hf_token`` secret file, ``distributed.token``) and never appears in the card,
the commit message or an error.
"""

from __future__ import annotations

import json
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from speedtronic.config import SpeedtronicConfig
from speedtronic.config.limits import is_hub_repo_id
from speedtronic.config.redaction import scrub
from speedtronic.json_types import JSON
from speedtronic.train.scoring import Weights

__all__ = ["Exported", "PushResult", "eval_history", "export_weights", "model_card", "push_model"]


@dataclass(frozen=True)
class PushResult:
    """What :func:`push_model` uploaded: the repo, its commit URL and the files (sorted)."""

    repo_id: str
    commit_url: str
    files: list[str]
    step: int | None


def eval_history(events: Path) -> list[JSON]:
    """The ``eval`` events (``step``, ``loss``, ``scope``) of the last run recorded in the JSONL
    file ``events`` (a file appended to by several runs keeps them apart by ``run_id``)."""
    if not events.is_file():
        return []
    runs: dict[str, list[JSON]] = {}
    last = ""
    with open(events, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            last = str(record.get("run_id", last))
            if record.get("event") == "eval" and isinstance(record.get("loss"), (int, float)):
                runs.setdefault(last, []).append(record)
    return runs.get(last, [])


def _events_file(config: SpeedtronicConfig, checkpoint: str | None) -> Path | None:
    """The run's JSONL: where the config puts it, else beside the checkpoint's folder."""
    if config.logging.json_file is None:
        return None
    configured = Path(config.events_path)
    if configured.is_file() or checkpoint is None:
        return configured
    beside = Path(checkpoint).resolve().parent.parent / Path(config.logging.json_file).name
    return beside if beside.is_file() else configured


def _loss_table(history: list[JSON]) -> list[str]:
    if not history:
        return ["No held-out evaluation was recorded for this run."]
    best = min(history, key=lambda r: r["loss"])
    final = history[-1]
    lines = [
        f"Held-out loss (mean cross-entropy, nats): final **{final['loss']:.4f}** at step "
        f"{final.get('step')}, best **{best['loss']:.4f}** at step {best.get('step')}.",
        "",
        "| step | scope | held-out loss |",
        "|---:|---|---:|",
    ]
    shown = history if len(history) <= 20 else history[:: max(1, len(history) // 20)]
    if shown[-1] is not final:
        shown = [*shown, final]
    lines += [f"| {r.get('step')} | {r.get('scope', 'local')} | {r['loss']:.4f} |" for r in shown]
    return lines


def _diloco_lines(config: SpeedtronicConfig) -> list[str]:
    dist = config.distributed
    if not dist.enabled:
        return ["Trained on one node (no DiLoCo rounds)."]
    shared = (dist.repo_id or "").startswith("file:")
    where = "a shared directory" if shared else "a Hub repo"
    return [
        f"DiLoCo rounds through {where}: {dist.inner_steps} inner steps per round, sync "
        f"`{dist.sync}`, outer learning rate {dist.outer_lr}, outer momentum "
        f"{dist.outer_momentum}, deltas sent as `{dist.delta_dtype}`, the global as "
        f"`{dist.global_dtype}`, at least {dist.min_nodes} node(s) per round.",
    ]


def model_card(
    config: SpeedtronicConfig,
    *,
    repo_id: str,
    parameters: int,
    step: int | None,
    tokens: int | None,
    history: list[JSON],
    source: str,
) -> str:
    """The ``README.md`` of a pushed model (Markdown with a metadata block); it holds the
    redacted config only, and the token is scrubbed from the whole text once more."""
    from speedtronic import __version__

    model = config.model
    versions = {
        "speedtronic": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - export needs it, so it is there
        pass
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["speedtronic", "llama", *(["diloco"] if config.distributed.enabled else [])],
    }
    trained = f"{step:,} optimizer steps" if step is not None else "an unknown number of steps"
    if tokens:
        trained += f", {tokens:,} tokens per node"
    redacted = yaml.safe_dump(config.to_dict(redact_secrets=True), sort_keys=False)
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {config.run.name}",
        "",
        f"A `LlamaForCausalLM` of {parameters:,} parameters trained with Speedtronic: "
        f"{model.n_layer} layers, width {model.d_model}, {model.n_head} attention heads "
        f"({model.n_kv_head or model.n_head} key/value heads), vocabulary {model.vocab_size}, "
        f"context {model.max_seq_len} tokens, {'tied' if model.tie_weights else 'separate'} "
        "input and output embeddings.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        "```",
        "",
        "## Training",
        "",
        f"Weights from `{Path(source).name}` after {trained}; batch "
        f"{config.data.target_batch_size} x {config.data.block_size or model.max_seq_len} tokens, "
        f"optimizer `{config.optimizer.name}` (lr {config.optimizer.lr}), precision "
        f"`{config.precision.mode}`.",
        "",
        *_diloco_lines(config),
        "",
        "## Evaluation",
        "",
        *_loss_table(history),
        "",
        "## Software",
        "",
        ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "## Training config (redacted)",
        "",
        "```yaml",
        redacted.rstrip(),
        "```",
        "",
    ]
    return scrub("\n".join(lines), [config.distributed.token])


@dataclass(frozen=True)
class Exported:
    """A transformers folder written from a run's weights, and what it came from."""

    folder: Path
    model: torch.nn.Module
    weights: Weights
    parameters: int


def export_weights(
    config: SpeedtronicConfig,
    output: str | Path,
    *,
    checkpoint: str | None = None,
    use_global: bool = False,
    overwrite: bool = False,
) -> Exported:
    """The weights :func:`speedtronic.train.scoring.load_model` finds (the newest checkpoint,
    ``checkpoint``, or the published global), written by
    :func:`speedtronic.model.export.export_hf` at ``output`` with the run's tokenizer and a
    ``speedtronic.json`` provenance record: what ``speedtronic export`` and ``push`` write."""
    from speedtronic.config.tokenizer_file import is_bytes
    from speedtronic.data.tokenizer import tokenizer_for
    from speedtronic.model.export import check_exportable, export_hf
    from speedtronic.train.scoring import load_model

    check_exportable(config.model)
    model, weights = load_model(config, checkpoint=checkpoint, use_global=use_global)
    tokenizer = None if is_bytes(config.data.tokenizer) else tokenizer_for(config)
    provenance = {
        "source": weights.source,
        "step": weights.step,
        "outer_step": weights.outer_step,
        "config": config.to_dict(redact_secrets=True),
    }
    folder = export_hf(
        model,
        output,
        model_name=config.model.name,
        tokenizer=tokenizer,
        provenance=provenance,
        overwrite=overwrite,
    )
    return Exported(folder, model, weights, sum(p.numel() for p in model.parameters()))


def _generation_config(folder: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)


def push_model(
    config: SpeedtronicConfig,
    *,
    repo_id: str,
    checkpoint: str | None = None,
    use_global: bool = False,
    private: bool = False,
    endpoint: str | None = None,
    log: Callable[[str], None] | None = None,
) -> PushResult:
    """Export the weights :func:`speedtronic.train.scoring.load_model` finds and upload them
    with a model card to the Hub model repo ``repo_id`` in one commit (see the module)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    from speedtronic.retry import retry_policy_from_config

    if not is_hub_repo_id(repo_id):
        raise ValueError(f"--repo {repo_id!r} is not a Hub repo id: expected owner/name")
    say = log or (lambda message: None)
    token = config.distributed.token
    policy = retry_policy_from_config(config.distributed)
    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="speedtronic-push-") as scratch:
        exported = export_weights(
            config, Path(scratch) / "model", checkpoint=checkpoint, use_global=use_global
        )
        folder, weights = exported.folder, exported.weights
        events = _events_file(config, checkpoint)
        history = eval_history(events) if events is not None else []
        block = config.data.block_size or config.model.max_seq_len
        tokens = weights.step * config.data.target_batch_size * block if weights.step else None
        card = model_card(
            config,
            repo_id=repo_id,
            parameters=exported.parameters,
            step=weights.step,
            tokens=tokens,
            history=history,
            source=weights.source,
        )
        _generation_config(folder)
        (folder / "README.md").write_text(card, encoding="utf-8")
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        operations = [
            CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in files
        ]
        at = f" at step {weights.step}" if weights.step is not None else ""
        message = scrub(f"speedtronic: {config.run.name}{at}", [token])
        kind = "private" if private else "public"
        say(f"pushing {len(files)} files to {repo_id} ({kind} model repo)")
        policy.run(
            f"create the Hub repo {repo_id}",
            lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
        )
        commit = policy.run(
            f"commit to {repo_id}",
            lambda: api.create_commit(repo_id, operations=operations, commit_message=message),
        )
    return PushResult(repo_id, str(commit.commit_url), files, weights.step)
