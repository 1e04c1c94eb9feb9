"""``speedtronic push``: a checkpoint as a Hugging Face Hub model repo, with its model card.

::

    result = push_model(config, repo_id="owner/name", checkpoint="runs/x/checkpoints/...")

The weights are exported exactly as ``speedtronic export --format hf`` writes them
(:func:`speedtronic.model.export.export_hf`: ``config.json``, ``model.safetensors``, the tokenizer
files, ``speedtronic.json``), plus ``generation_config.json`` and a ``README.md`` model card
(:func:`model_card`): architecture and size, steps and tokens trained, the held-out loss
history of the run (final and best: the evaluations the checkpoint carries, else the JSONL log
of the run the checkpoint belongs to), the DiLoCo setup, the training config and the software
versions. The repo is created when missing (``private=True`` makes it private; an existing
repo keeps its visibility, and the log line says which it has) and everything goes up in **one
commit** through huggingface_hub's public ``HfApi.create_commit``, under the run's retry policy
(``distributed.retry_*``; 429 honours ``Retry-After``). The token comes from the usual layers
(``HF_TOKEN``, the ``hf_token`` secret file, ``distributed.token``) and never appears in the card,
the commit message or an error; a 401/403 says to set ``HF_TOKEN``.

Nothing local is published: the config in the card and in ``speedtronic.json`` holds no
secret (redacted) and no absolute path (:func:`public_config`: a path outside the working
folder keeps its last two names), the weights' source is named the same way, the whole text is
scrubbed of the token and of anything shaped like one, and text that comes from the config
(``run.name``) cannot add lines, HTML or a code fence to the card (:func:`inline`).
"""

from __future__ import annotations

import contextlib
import html
import json
import platform
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
import yaml

from speedtronic.config import SpeedtronicConfig
from speedtronic.config.limits import is_hub_repo_id
from speedtronic.config.redaction import scrub
from speedtronic.json_types import JSON
from speedtronic.train.scoring import Weights

__all__ = [
    "Exported",
    "PushResult",
    "eval_history",
    "export_weights",
    "inline",
    "model_card",
    "public_config",
    "public_path",
    "push_model",
]


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


def public_path(value: str) -> str:
    """``value`` as it may be published: a relative path inside the working folder as given;
    an absolute one (``/``, ``~``, ``file:///``) or one that climbs out (``..``) only its last
    two names, after ``.../`` (``/home/me/runs/x`` -> ``.../runs/x``). Other text is kept."""
    prefix, rest = ("file://", value[7:]) if value.startswith("file://") else ("", value)
    path = PurePosixPath(rest)
    if not (path.is_absolute() or rest.startswith("~") or ".." in path.parts):
        return value
    names = [part for part in path.parts if part not in ("/", "..") and not part.startswith("~")]
    return f"{prefix}.../{'/'.join(names[-2:])}"


def public_config(config: SpeedtronicConfig) -> JSON:
    """The redacted config with every string :func:`public_path` made publishable."""

    def clean(value: object) -> object:
        if isinstance(value, str):
            return public_path(value)
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list):
            return [clean(item) for item in value]
        return value

    cleaned = clean(config.to_dict(redact_secrets=True))
    assert isinstance(cleaned, dict)
    return cleaned


def inline(text: object) -> str:
    """Config text made safe inside one line of Markdown: whitespace (newlines too) collapsed
    to single spaces, and ``<``, ``>``, ``&``, quotes and backticks escaped as HTML entities."""
    return html.escape(" ".join(str(text).split())).replace("`", "&#96;")


def _fenced(text: str, language: str) -> list[str]:
    """``text`` in a code fence longer than any run of backticks inside it (CommonMark: a
    shorter run cannot close it), so the text cannot end the block early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{language}", text, fence]


def _run_folder(source: str) -> Path | None:
    """The run folder the weights ``source`` belongs to: above its ``checkpoints/`` (a trainer
    checkpoint) or ``final/`` (a DiLoCo master's final folder); None when it is no local path."""
    path = Path(source)
    if not path.exists():
        return None
    folder = path.parent if path.is_file() else path
    return folder.resolve().parent


def _history(config: SpeedtronicConfig, weights: Weights, checkpoint: str | None) -> list[JSON]:
    """The held-out evaluations for the card: those the weights' checkpoint carries; else the
    JSONL log of the run the checkpoint belongs to (not ``config``'s run), or with no
    ``--checkpoint`` the config's; else those the newest checkpoint of that run carries (a
    DiLoCo ``final/`` folder carries none itself)."""
    from speedtronic.checkpoint import CheckpointManager
    from speedtronic.train.state import eval_records

    if weights.evals:
        return weights.evals
    run = _run_folder(weights.source) if checkpoint else config.output_path
    if run is None:
        return []
    logs = [run / Path(config.logging.json_file).name] if config.logging.json_file else []
    if checkpoint is None and config.events_path is not None:
        logs.insert(0, config.events_path)
    for log in [*logs, run / "events.jsonl"]:
        if history := eval_history(log):
            return history
    manager = CheckpointManager(run / config.checkpoint.directory, warn=lambda message: None)
    state = manager.load_latest() if manager.directory.is_dir() else None
    evals = state.get("evals") if state is not None else None
    return eval_records(evals.get("records")) if isinstance(evals, dict) else []


def _loss_table(history: list[JSON]) -> list[str]:
    if not history:
        return ["No held-out evaluation was recorded for this run."]
    best = min(history, key=lambda r: r["loss"])
    final = history[-1]
    lines = [
        f"Held-out loss (mean cross-entropy, nats): final **{final['loss']:.4f}** at step "
        f"{inline(final.get('step'))}, best **{best['loss']:.4f}** at step "
        f"{inline(best.get('step'))}.",
        "",
        "| step | scope | held-out loss |",
        "|---:|---|---:|",
    ]
    shown = history if len(history) <= 20 else history[:: max(1, len(history) // 20)]
    if shown[-1] is not final:
        shown = [*shown, final]
    # a log is a file that arrives: what it says is escaped like any text on the card
    lines += [
        f"| {inline(r.get('step'))} | {inline(r.get('scope', 'local'))} | {r['loss']:.4f} |"
        for r in shown
    ]
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
    :func:`public_config` only, text from the config is :func:`inline` or fenced, and the token
    is scrubbed from the whole text once more."""
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
    published = yaml.safe_dump(public_config(config), sort_keys=False, allow_unicode=True)
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {inline(config.run.name)}",
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
        f"Weights from `{inline(Path(source).name)}` after {trained}; batch "
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
        *_fenced(published.rstrip(), "yaml"),
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
    ``speedtronic.json`` provenance record (source, step, outer step, :func:`public_config`;
    scrubbed): what ``speedtronic export`` and ``push`` write."""
    from speedtronic.config.tokenizer_file import is_bytes
    from speedtronic.data.tokenizer import tokenizer_for
    from speedtronic.model.export import check_exportable, export_hf
    from speedtronic.train.scoring import load_model

    check_exportable(config.model)
    model, weights = load_model(config, checkpoint=checkpoint, use_global=use_global)
    tokenizer = None if is_bytes(config.data.tokenizer) else tokenizer_for(config)
    provenance = {  # published as is by push: no local path, no secret (see the module)
        "source": public_path(weights.source),
        "step": weights.step,
        "outer_step": weights.outer_step,
        "config": public_config(config),
    }
    provenance = json.loads(scrub(json.dumps(provenance), [config.distributed.token]))
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
        history = _history(config, weights, checkpoint)
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
        message = scrub(f"speedtronic: {' '.join(config.run.name.split())}{at}", [token])
        with _access(repo_id, token):
            policy.run(
                f"create the Hub repo {repo_id}",
                lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
            )
            info = policy.run(f"read the Hub repo {repo_id}", lambda: api.model_info(repo_id))
            kind = "private" if info.private else "public"  # an existing repo keeps its own
            say(f"pushing {len(files)} files to {repo_id} ({kind} model repo)")
            commit = policy.run(
                f"commit to {repo_id}",
                lambda: api.create_commit(repo_id, operations=operations, commit_message=message),
            )
    return PushResult(repo_id, str(commit.commit_url), files, weights.step)


@contextlib.contextmanager
def _access(repo_id: str, token: str | None) -> Iterator[None]:
    """A refusal by the Hub (HTTP 401/403) as one line that says what to set (exit 2)."""
    from speedtronic.retry import AccessRefused, TransportError

    try:
        yield
    except TransportError as exc:
        if exc.status not in (401, 403):
            raise
        if not token:
            problem = "requires a token and none is configured"
        elif exc.status == 401:
            problem = "rejected the token"
        else:
            problem = "refused to let this token write"
        raise AccessRefused(
            f"the Hub {problem} (HTTP {exc.status}) for {repo_id}: set HF_TOKEN (or the "
            "hf_token secret file) to a token with write access to it",
            status=exc.status,
        ) from None
