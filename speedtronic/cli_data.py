"""The data and model commands of the ``speedtronic`` CLI: ``prepare``, ``export``, ``sample``.

Part of the command line (it prints; :mod:`speedtronic.cli` owns exit codes). Bad input is
raised as ``ConfigError``, which the CLI reports as one ``error: ...`` line with exit 2. Heavy
modules (numpy, torch, tokenizers, transformers) are imported inside the commands only.
"""

from __future__ import annotations

import argparse
import sys
from typing import IO, TYPE_CHECKING, NoReturn

from speedtronic.config import ConfigError

if TYPE_CHECKING:
    from tqdm import tqdm

    from speedtronic.config import SpeedtronicConfig
    from speedtronic.train.scoring import Weights

__all__ = [
    "add_data_commands",
    "export_command",
    "prepare_command",
    "push_command",
    "sample_command",
]


def _weights_flags(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="as for eval (default: the newest checkpoint of the config's checkpoint directory)",
    )
    source.add_argument(
        "--global",
        dest="use_global",
        action="store_true",
        help="the DiLoCo global published in distributed.repo_id",
    )


def add_data_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    reading: argparse.ArgumentParser,
    writing: argparse.ArgumentParser,
) -> None:
    """``prepare``, ``export`` and ``sample`` (docs/data.md); ``reading``/``writing``: the
    config flags of a command that computes (``sample``) and of one that does not (``export``)."""
    prepare = commands.add_parser(
        "prepare", help="tokenize text / JSONL / Parquet files into token shards + meta.json"
    )
    prepare.add_argument(
        "--input",
        "-i",
        dest="inputs",
        nargs="+",
        action="extend",
        required=True,
        metavar="PATH",
        help="text, JSONL (.jsonl) or Parquet (.parquet) files, folders of them, or a Hub "
        "dataset: hf://datasets/<owner>/<name>[@<revision>][/<path>]",
    )
    prepare.add_argument("--output", "-o", required=True, metavar="DIR")
    prepare.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="T",
        help="bytes (default), a tokenizer.json path or a Hub repo id (as data.tokenizer)",
    )
    prepare.add_argument(
        "--field", default="text", help="JSONL field / Parquet column holding the text"
    )
    prepare.add_argument(
        "--holdout", default="0", metavar="F", help="fraction of documents kept for eval"
    )
    prepare.add_argument("--workers", type=int, default=1, metavar="N", help="processes")
    prepare.add_argument(
        "--shard-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens per shard (default 134217728)",
    )
    prepare.add_argument(
        "--utf8",
        choices=("replace", "strict"),
        default="replace",
        help="invalid UTF-8: replace and count it (default) or refuse the file",
    )
    prepare.add_argument(
        "--overwrite", action="store_true", help="replace another corpus in --output"
    )
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")

    export = commands.add_parser(
        "export", parents=[writing], help="write a checkpoint as a transformers model folder"
    )
    _weights_flags(export)
    export.add_argument("--format", choices=("hf",), default="hf")
    export.add_argument("--output", "-o", required=True, metavar="DIR")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    export.add_argument(
        "--verify", action="store_true", help="load DIR with transformers and compare logits"
    )

    push = commands.add_parser(
        "push", parents=[writing], help="upload a checkpoint to a Hub model repo with a model card"
    )
    _weights_flags(push)
    push.add_argument("--repo", required=True, metavar="OWNER/NAME", help="Hub model repo")
    push.add_argument("--private", action="store_true", help="create the repo private")

    sample = commands.add_parser(
        "sample", parents=[reading], help="continue a prompt with a checkpoint (seeded)"
    )
    _weights_flags(sample)
    sample.add_argument("--prompt", default="", metavar="TEXT")
    sample.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    sample.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy")
    sample.add_argument("--top-k", type=int, default=50, metavar="K", help="0: no cut")
    sample.add_argument("--seed", type=int, default=0, metavar="S")


def prepare_command(args: argparse.Namespace) -> int:
    """``speedtronic prepare``: one summary line on stdout; notes and the bar on stderr."""
    from speedtronic.data.prepare import DEFAULT_SHARD_TOKENS, PrepareError, prepare
    from speedtronic.hub_files import HubFilesError, resolve_inputs

    try:
        inputs = resolve_inputs(args.inputs)
    except HubFilesError as exc:
        raise ConfigError(str(exc)) from None
    bar = _ProgressBar(enabled=not args.no_progress)
    try:
        result = prepare(
            inputs,
            args.output,
            tokenizer=args.tokenizer,
            field=args.field,
            holdout=_fraction(args.holdout),
            workers=args.workers,
            shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
            utf8=args.utf8,
            overwrite=args.overwrite,
            log=bar.note,
            progress=bar.update,
            on_start=bar.start,
        )
    except PrepareError as exc:
        raise ConfigError(str(exc)) from None
    finally:
        bar.close()
    meta = result.meta
    shards = {split: len(entries) for split, entries in meta["shards"].items()}
    print(
        f"{result.status} {result.output}: {meta['tokens']['train']} train tokens in "
        f"{shards['train']} shards, {meta['tokens']['eval']} held-out tokens in "
        f"{shards['eval']} shards, {sum(meta['documents'].values())} documents "
        f"({meta['dtype']}, tokenizer {meta['tokenizer']['spec']})"
    )
    return 0


def _fraction(text: str) -> str:
    try:
        float(text)
    except ValueError:
        raise ConfigError(f"--holdout must be a number in [0, 1), got {text!r}") from None
    return text


class _ProgressBar:
    """tqdm on stderr (input bytes, with tokens/s) when stderr is a terminal; notes are
    printed above it (without a bar: one ``note:`` line each, nothing redrawn in a log)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled and _is_terminal(sys.stderr)
        self.bar: tqdm[NoReturn] | None = None  # a bar over a byte count, not an iterable
        self.tokens = 0

    def start(self, total_bytes: int) -> None:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=sys.stderr
            )

    def update(self, nbytes: int, ntokens: int) -> None:
        self.tokens += ntokens
        if self.bar is not None:
            self.bar.update(nbytes)
            elapsed = self.bar.format_dict.get("elapsed") or 0.0
            rate = self.tokens / elapsed if elapsed > 0 else 0.0
            self.bar.set_postfix_str(f"{self.tokens} tok, {rate:,.0f} tok/s", refresh=False)

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(f"note: {message}", file=sys.stderr)
        else:
            print(f"note: {message}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def export_command(args: argparse.Namespace, config: SpeedtronicConfig) -> int:
    """``speedtronic export``: the folder written (and, with ``--verify``, the logit check)."""
    from speedtronic.checkpoint import CheckpointError
    from speedtronic.model.export import ExportError, verify_export
    from speedtronic.publish import export_weights

    try:
        exported = export_weights(
            config,
            args.output,
            checkpoint=args.checkpoint,
            use_global=args.use_global,
            overwrite=args.overwrite,
        )
        model, weights, folder = exported.model, exported.weights, exported.folder
        print(f"exported {_loaded(weights)} to {folder} (LlamaForCausalLM, fp32)")
        if args.verify:
            print(f"verified: max |logit difference| = {verify_export(model, folder):.3g}")
    except (CheckpointError, ExportError) as exc:
        raise ConfigError(str(exc)) from None
    return 0


def push_command(args: argparse.Namespace, config: SpeedtronicConfig) -> int:
    """``speedtronic push``: the repo, the step and the files uploaded in one commit."""
    from speedtronic.checkpoint import CheckpointError
    from speedtronic.model.export import ExportError
    from speedtronic.publish import push_model
    from speedtronic.retry import HubUnavailable, TransportError

    try:
        result = push_model(
            config,
            repo_id=args.repo,
            checkpoint=args.checkpoint,
            use_global=args.use_global,
            private=args.private,
            log=lambda message: print(message, file=sys.stderr),
        )
    except HubUnavailable:
        raise  # the Hub did not answer after the retries: a runtime failure (exit 1)
    except (CheckpointError, ExportError, TransportError, ValueError) as exc:
        raise ConfigError(str(exc)) from None  # refused, missing, malformed: exit 2
    step = f" (step {result.step})" if result.step is not None else ""
    print(f"pushed {result.repo_id}{step}: {', '.join(result.files)} in one commit")
    return 0


def sample_command(args: argparse.Namespace, config: SpeedtronicConfig) -> int:
    """``speedtronic sample``: the prompt and its continuation on stdout."""
    from speedtronic.checkpoint import CheckpointError
    from speedtronic.train.sampling import sample

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens, --temperature and --top-k cannot be negative")
    try:
        result = sample(
            config,
            prompt=args.prompt,
            checkpoint=args.checkpoint,
            use_global=args.use_global,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            seed=args.seed,
        )
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    print(f"loaded {_loaded(result.weights)}", file=sys.stderr)
    print(result.text)
    return 0


def _loaded(weights: Weights) -> str:
    """Which weights a command used: ``<file> (step N, outer step M)`` as far as known."""
    known = [f"step {weights.step}"] if weights.step is not None else []
    if weights.outer_step is not None:
        known.append(f"outer step {weights.outer_step}")
    return f"{weights.source} ({', '.join(known)})" if known else str(weights.source)


def _is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (a bar redrawn in a file or a pipe is noise)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False
