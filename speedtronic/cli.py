"""The ``speedtronic`` command line (the only module that prints or exits).

Commands (the config path comes from ``--config`` or ``SPEEDTRONIC_CONFIG``; ``--set
section.field=value`` is repeatable; each command lists only the flags it reads)::

    speedtronic validate [--resume] [--init-from SOURCE] [--format text|json]  # dry run of train
    speedtronic config show [--sources] [--format yaml|json]   # the merged, redacted config
    speedtronic config schema                              # JSON Schema of a config file
    speedtronic config docs [--write docs/configuration.md] # the generated field tables
    speedtronic train [--max-steps N] [--resume] [--init-from SOURCE]  # entrypoint.launch
    speedtronic run [--max-steps N] [--resume] [--init-from SOURCE]    # + metrics server
    speedtronic plot EVENTS [--output PNG] [--each-run]     # last run, or every run apart
    speedtronic eval [--checkpoint PATH | --global] [--format text|json]   # held-out loss
    speedtronic prepare --input PATH... --output DIR [--tokenizer T] [--holdout F] [--workers N]
    speedtronic export [--checkpoint PATH | --global] --format hf --output DIR
    speedtronic sample [--checkpoint PATH | --global] --prompt TEXT [--max-new-tokens N] ...

``run`` without ``--config`` and ``SPEEDTRONIC_CONFIG`` runs the embedded main job: the DiLoCo
default shipped inside the package (``speedtronic/defaults/diloco.yaml``, byte for byte
``configs/diloco.yaml``). ``prepare`` takes no config (``--tokenizer``, default ``bytes``, is
what ``data.tokenizer`` accepts); ``export``, ``sample`` and ``eval`` read the model shape and
tokenizer from ``--config``, or, given only ``--checkpoint PATH``, from the run config the
checkpoint carries (a trainer checkpoint or directory, or a DiLoCo ``final/`` folder).

Exit codes: 0 success; 2 configuration error (one ``error: ...`` line on stderr, no
traceback); 1 any other failure (one ``error: <Type>: ...`` line); 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from speedtronic.cli_data import add_data_commands
from speedtronic.config import ConfigError, ResolvedConfig, resolve_config
from speedtronic.config.redaction import scrub
from speedtronic.defaults import MAIN_JOB
from speedtronic.json_types import JSON

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


class _CommandError(Exception):
    """A usage problem detected after parsing (reported like a configuration error)."""


def _config_flags(
    *, steps: bool = True, device: bool = True, resume: bool = True
) -> argparse.ArgumentParser:
    """The configuration flags as an argparse parent: ``--config``, ``--output-dir`` and
    ``--set`` for every command that reads a config; ``--max-steps`` (``steps``) where the run
    target matters, ``--device`` where the command computes or shows the config, ``--resume``
    where a run starts (or is dry-run)."""
    flags = argparse.ArgumentParser(add_help=False)
    group = flags.add_argument_group("configuration")
    group.add_argument(
        "--config",
        metavar="PATH",
        help="config file (YAML/JSON) or inline YAML; default: $SPEEDTRONIC_CONFIG",
    )
    if steps:
        group.add_argument("--max-steps", type=int, metavar="N", help="set the run target")
    group.add_argument("--output-dir", metavar="PATH", help="set run.output_dir")
    if device:
        group.add_argument(
            "--device", metavar="DEVICE", help="set run.device (auto, cpu, cuda, ...)"
        )
    if resume:
        group.add_argument(
            "--resume", action="store_true", help="resume from the latest local checkpoint"
        )
    group.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field (repeatable); the value is parsed as YAML",
    )
    return flags


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree for ``speedtronic``."""
    from speedtronic import __version__

    parser = argparse.ArgumentParser(
        prog="speedtronic", description="Efficient training with optional DumbDiLoCo"
    )
    parser.add_argument("--version", action="version", version=f"speedtronic {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    training = _config_flags()  # train, run and their dry run (validate)
    shown = _config_flags(resume=False)  # config show: the config a run would get
    reading = _config_flags(steps=False, resume=False)  # eval, sample: load and compute
    writing = _config_flags(steps=False, device=False, resume=False)  # export

    validate = commands.add_parser(
        "validate",
        parents=[training],
        help="dry run of train: open every file the run reads, print its start-up warnings "
        "and a verdict",
    )
    validate.add_argument("--format", choices=("text", "json"), default="text")

    config = commands.add_parser("config", help="inspect the merged configuration")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_commands.add_parser(
        "show", parents=[shown], help="print the merged, redacted config"
    )
    show.add_argument("--sources", action="store_true", help="also print where values came from")
    show.add_argument("--format", choices=("yaml", "json"), default="yaml")
    config_commands.add_parser("schema", help="print the JSON Schema of a config file")
    docs = config_commands.add_parser("docs", help="print the field tables of the docs")
    docs.add_argument(
        "--write", metavar="MARKDOWN", help="replace the generated part of this file instead"
    )

    train = commands.add_parser("train", parents=[training], help="train locally (CLI progress)")
    run = commands.add_parser(
        "run",
        parents=[training],
        help="container entrypoint (metrics server); without a config: the embedded main job",
    )
    for launcher in (validate, train, run):
        launcher.add_argument(
            "--init-from",
            metavar="SOURCE",
            help="set model.init_from: a transformers checkpoint folder or owner/name[@revision]",
        )
    for launcher in (train, run):
        launcher.add_argument(
            "--overwrite",
            dest="overwrite_run",
            action="store_true",
            help="start a new run in a folder that holds another run's checkpoints (they are "
            "deleted; checkpoint.overwrite)",
        )

    evaluate = commands.add_parser(
        "eval", parents=[reading], help="score a checkpoint or the DiLoCo global on held-out data"
    )
    source = evaluate.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="a .pt checkpoint, a checkpoint directory, a .safetensors file or a final/ "
        "directory (default: the newest checkpoint of the config's checkpoint directory)",
    )
    source.add_argument(
        "--global",
        dest="use_global",
        action="store_true",
        help="score the DiLoCo global published in distributed.repo_id",
    )
    evaluate.add_argument("--format", choices=("text", "json"), default="text")
    add_data_commands(commands, reading, writing)

    plot = commands.add_parser("plot", help="plot a JSONL event log")
    plot.add_argument("source", help="events.jsonl file or run directory")
    plot.add_argument("--output", "-o", help="image path (default: beside the source)")
    plot.add_argument(
        "--each-run",
        action="store_true",
        help="draw every run of the log as its own series (default: the last run, joined with "
        "the runs it resumed from)",
    )
    return parser


def _resolve(args: argparse.Namespace) -> ResolvedConfig:
    """Layered config for a command: file < secrets < env < --set/--max-steps/--output-dir.

    The file: ``--config``, else ``SPEEDTRONIC_CONFIG``, else the run config a ``--checkpoint``
    carries (``eval``/``sample``/``export``), else, for ``run``, the embedded main job."""
    options = vars(args)  # each command has its own options
    max_steps = options.get("max_steps")
    device = options.get("device")
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"run.output_dir={args.output_dir}")
    if device:
        overrides.append(f"run.device={device}")
    if max_steps is not None:
        overrides.append(f"run.max_steps={max_steps}")
    if options.get("init_from"):
        overrides.append(f"model.init_from={args.init_from}")  # a string field takes it as is
    if options.get("overwrite_run"):
        overrides.append("checkpoint.overwrite=true")
    source = args.config
    named = source is not None or bool(os.environ.get("SPEEDTRONIC_CONFIG"))
    if not named:
        source = _checkpoint_source(args)
    if not named and source is None and args.command == "run":
        source = str(MAIN_JOB)
    if not named and source is None:
        raise _CommandError(
            "no configuration given: pass --config PATH or set SPEEDTRONIC_CONFIG "
            "(`speedtronic run` without either runs the embedded main job)"
        )
    resolved = resolve_config(source, environ=os.environ, overrides=overrides)
    config = resolved.config
    args.secret_values = [config.distributed.token] if config.distributed.token else []
    if max_steps is not None and config.effective_max_steps != max_steps:
        config.apply_run_target(max_steps)  # --max-steps also beats data.max_steps
        resolved.sources["data.max_steps"] = "cli"
    if args.command in ("eval", "export", "sample", "push"):  # init_from's shape and tokenizer
        from speedtronic.model.hf_import import resolve_init_from

        resolve_init_from(config, weights=False)
    return resolved


def _checkpoint_source(args: argparse.Namespace) -> JSON | None:
    """``export``/``sample``/``eval --checkpoint PATH`` without a config: the run config the
    checkpoint carries (redacted: a token comes from HF_TOKEN or a secret file again)."""
    commands = ("export", "sample", "eval", "push")
    if args.command not in commands or not vars(args).get("checkpoint"):
        return None
    from speedtronic.checkpoint import CheckpointError, checkpoint_config
    from speedtronic.config import REDACTED

    try:
        values = checkpoint_config(args.checkpoint)
    except CheckpointError as exc:
        raise _CommandError(str(exc)) from None
    distributed = values.get("distributed")
    if isinstance(distributed, dict) and distributed.get("token") == REDACTED:
        values["distributed"] = {**distributed, "token": None}
    return values


def _dump(payload: object, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(payload, indent=2)
    import yaml

    return yaml.safe_dump(payload, sort_keys=False, allow_unicode=True).rstrip("\n")


def _cmd_validate(args: argparse.Namespace) -> int:
    """The dry run of ``train`` (`speedtronic.train.preflight`): the files it opens and the
    notes on stdout, its start-up warnings on stderr, then one verdict line. Every line is
    scrubbed of the token (a repo id or path may carry it)."""
    config = _resolve(args).config
    from speedtronic.train.preflight import preflight

    report = preflight(config, resume=args.resume)
    secrets = [*args.secret_values, os.environ.get("HF_TOKEN")]
    if args.format == "json":
        print(scrub(json.dumps(report.as_dict(), indent=2), secrets))
        return EXIT_OK
    lines = [f"opened {name}: {path}" for name, path in report.files]
    if report.resume_from:
        lines.append(f"resume from {report.resume_from}")
    for line in [*lines, *report.notes]:
        print(scrub(line, secrets))
    for warning in report.warnings:
        print(f"warning: {_one_line(warning, args.secret_values)}", file=sys.stderr)
    print(scrub(report.verdict(), secrets))
    return EXIT_OK


def _cmd_config_show(args: argparse.Namespace) -> int:
    resolved = _resolve(args)
    redacted = resolved.config.to_dict(redact_secrets=True)
    if args.sources:
        print(_dump({"config": redacted, "sources": resolved.sources}, args.format))
    else:
        print(_dump(redacted, args.format))
    return EXIT_OK


def _cmd_config(args: argparse.Namespace) -> int:
    """``config show|schema|docs``: the merged config, or what the field declarations publish."""
    from speedtronic.config import reference

    if args.config_command == "show":
        return _cmd_config_show(args)
    if args.config_command == "schema":
        print(reference.schema_text(), end="")
        return EXIT_OK
    if not args.write:
        print(reference.field_tables(), end="")
        return EXIT_OK
    path = Path(args.write)
    text = path.read_text(encoding="utf-8")
    if reference.BEGIN not in text or reference.END not in text:
        raise _CommandError(f"{path} has no {reference.BEGIN} ... {reference.END} block")
    head, rest = text.split(reference.BEGIN, 1)
    tail = rest.split(reference.END, 1)[1]
    path.write_text(head + reference.field_tables().rstrip("\n") + tail, encoding="utf-8")
    return EXIT_OK


def _cmd_launch(args: argparse.Namespace) -> int:
    """``train`` and ``run``: one runner (`speedtronic.entrypoint.launch`); ``train`` shows a
    progress bar on a terminal and prints a ``completed ...`` line."""
    resolved = _resolve(args)
    from speedtronic.entrypoint import launch

    train = args.command == "train"
    outcome = launch(
        resolved,
        command=args.command,
        resume=args.resume,
        progress=None if train else False,
        argv=args.argv,  # what the ranks run when run.nproc_per_node > 1
    )
    result = outcome.result
    if train and result is not None:
        stopped = result.stopped_reason
        loss = result.final_loss  # None when no step ran (resumed at the target)
        line = f"completed steps={result.steps} samples={result.samples} tokens={result.tokens}"
        line += "" if loss is None else f" loss={loss}"
        print(line + (f" stopped={stopped}" if stopped else ""))
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        _leave_rank(outcome.exit_code)
    return outcome.exit_code


def _leave_rank(code: int) -> None:
    """End a rank of a torchrun launch that finished cleanly: flush, then ``os._exit``.

    Skipping interpreter finalization avoids an abort in torch's process-group teardown
    ("terminate called without an active exception", SIGABRT) seen in about 1 of 10 runs of
    2 gloo ranks here, which the agent would report as a failed rank.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_plot(args: argparse.Namespace) -> int:
    from speedtronic.metrics.plot import plot_command

    source = Path(args.source)
    if not source.exists():
        raise _CommandError(f"plot source not found: {source}")
    output = args.output
    if not output:
        output = str(source / "loss.png") if source.is_dir() else str(source.with_suffix(".png"))
    print(plot_command(str(source), output, each_run=args.each_run))
    return EXIT_OK


def _cmd_eval(args: argparse.Namespace) -> int:
    config = _resolve(args).config
    from speedtronic.checkpoint import CheckpointError
    from speedtronic.train.scoring import score

    try:
        result = score(config, checkpoint=args.checkpoint, use_global=args.use_global)
    except CheckpointError as exc:
        raise _CommandError(str(exc)) from None
    result["checkpoint"] = result.pop("source")  # which file (and step) was scored
    if args.format == "json":
        print(json.dumps(result))
    else:
        shown = {key: value for key, value in result.items() if value is not None}
        print(" ".join(f"{key}={_text_value(value)}" for key, value in shown.items()))
    return EXIT_OK


def _cmd_prepare(args: argparse.Namespace) -> int:
    from speedtronic.cli_data import prepare_command

    return prepare_command(args)


def _cmd_export(args: argparse.Namespace) -> int:
    config = _resolve(args).config
    from speedtronic.cli_data import export_command

    return export_command(args, config)


def _cmd_sample(args: argparse.Namespace) -> int:
    config = _resolve(args).config
    from speedtronic.cli_data import sample_command

    return sample_command(args, config)


def _cmd_push(args: argparse.Namespace) -> int:
    config = _resolve(args).config
    from speedtronic.cli_data import push_command

    return push_command(args, config)


def _text_value(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


_COMMANDS = {
    "validate": _cmd_validate,
    "train": _cmd_launch,
    "run": _cmd_launch,
    "plot": _cmd_plot,
    "eval": _cmd_eval,
    "prepare": _cmd_prepare,
    "export": _cmd_export,
    "sample": _cmd_sample,
    "push": _cmd_push,
}


def _one_line(message: str, secrets: Sequence[str] = ()) -> str:
    """Collapse a message to a single line and scrub any token it might carry."""
    candidates = [
        *secrets,
        os.environ.get("HF_TOKEN"),
        os.environ.get("SPEEDTRONIC_DISTRIBUTED__TOKEN"),
    ]
    return " ".join(scrub(message, candidates).split())


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (survives redirection in tests)."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def _setup_logging() -> None:
    """Library warnings (e.g. a token in a YAML file) go to stderr as ``warning: ...``."""
    config_logger = logging.getLogger("speedtronic.config")
    if any(isinstance(handler, _StderrHandler) for handler in config_logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    config_logger.addHandler(handler)
    config_logger.setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (argparse usage errors raise SystemExit 2)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _setup_logging()
    handler = _cmd_config if args.command == "config" else _COMMANDS[args.command]
    args.secret_values = []
    try:
        return handler(args)
    except (ConfigError, _CommandError) as exc:
        print(f"error: {_one_line(str(exc), args.secret_values)}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_FAILURE
    except Exception as exc:  # one line, no traceback; the logs carry details
        message = _one_line(str(exc), args.secret_values)
        print(f"error: {type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
