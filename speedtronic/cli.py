"""The ``speedtronic`` command line (the only module that prints or exits).

Commands (every one takes ``--config``, ``--max-steps``, ``--output-dir``, ``--device``,
``--resume`` and repeatable ``--set section.field=value``; the config path may also come from
``SPEEDTRONIC_CONFIG``)::

    speedtronic validate [--format yaml|json]              # normalised, redacted config
    speedtronic config show [--sources] [--format yaml|json]
    speedtronic config schema                              # JSON Schema of a config file
    speedtronic config docs [--write docs/configuration.md] # the generated field tables
    speedtronic train                                      # speedtronic.entrypoint.launch
    speedtronic run                                        # the same runner + metrics server
    speedtronic plot EVENTS [--output PNG] [--each-run]     # last run, or every run apart
    speedtronic eval [--checkpoint PATH | --global] [--format text|json]   # held-out loss
    speedtronic prepare --input PATH... --output DIR [--tokenizer T] [--holdout F] [--workers N]
    speedtronic export [--checkpoint PATH | --global] --format hf --output DIR
    speedtronic sample [--checkpoint PATH | --global] --prompt TEXT [--max-new-tokens N] ...

``prepare`` takes no config (``--tokenizer``, default ``bytes``, is what ``data.tokenizer``
accepts); ``export``, ``sample`` and ``eval`` read the model shape and tokenizer from
``--config``, or, given only ``--checkpoint PATH``, from the run config the checkpoint carries
(a trainer checkpoint or directory, or a DiLoCo ``final/`` folder).

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
from typing import Any

from speedtronic.cli_data import add_data_commands
from speedtronic.config import ConfigError, ResolvedConfig, resolve_config
from speedtronic.config.redaction import scrub

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


class _CommandError(Exception):
    """A usage problem detected after parsing (reported like a configuration error)."""


def _common_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("configuration")
    group.add_argument(
        "--config",
        metavar="PATH",
        help="config file (YAML/JSON) or inline YAML; default: $SPEEDTRONIC_CONFIG",
    )
    group.add_argument("--max-steps", type=int, metavar="N", help="set the run target")
    group.add_argument("--output-dir", metavar="PATH", help="set run.output_dir")
    group.add_argument("--device", metavar="DEVICE", help="set run.device (auto, cpu, cuda, ...)")
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
    return common


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree for ``speedtronic``."""
    from speedtronic import __version__

    parser = argparse.ArgumentParser(
        prog="speedtronic", description="Efficient training with optional DumbDiLoCo"
    )
    parser.add_argument("--version", action="version", version=f"speedtronic {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = _common_flags()

    validate = commands.add_parser(
        "validate", parents=[common], help="load, validate and print the config"
    )
    validate.add_argument("--format", choices=("yaml", "json"), default="yaml")

    config = commands.add_parser("config", help="inspect the merged configuration")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_commands.add_parser(
        "show", parents=[common], help="print the merged, redacted config"
    )
    show.add_argument("--sources", action="store_true", help="also print where values came from")
    show.add_argument("--format", choices=("yaml", "json"), default="yaml")
    config_commands.add_parser("schema", help="print the JSON Schema of a config file")
    docs = config_commands.add_parser("docs", help="print the field tables of the docs")
    docs.add_argument(
        "--write", metavar="MARKDOWN", help="replace the generated part of this file instead"
    )

    train = commands.add_parser("train", parents=[common], help="train locally (CLI progress)")
    run = commands.add_parser("run", parents=[common], help="container entrypoint (metrics server)")
    for launcher in (train, run):
        launcher.add_argument(
            "--overwrite",
            dest="overwrite_run",
            action="store_true",
            help="start a new run in a folder that holds another run's checkpoints (they are "
            "deleted; checkpoint.overwrite)",
        )

    evaluate = commands.add_parser(
        "eval", parents=[common], help="score a checkpoint or the DiLoCo global on held-out data"
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
    add_data_commands(commands, common)

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
    """Layered config for a command: file < secrets < env < --set/--max-steps/--output-dir."""
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"run.output_dir={args.output_dir}")
    if args.device:
        overrides.append(f"run.device={args.device}")
    if args.max_steps is not None:
        overrides.append(f"run.max_steps={args.max_steps}")
    if getattr(args, "overwrite_run", False):
        overrides.append("checkpoint.overwrite=true")
    source = args.config
    if source is None and not os.environ.get("SPEEDTRONIC_CONFIG"):
        source = _checkpoint_source(args)
    if source is None and not os.environ.get("SPEEDTRONIC_CONFIG"):
        raise _CommandError("no configuration given: pass --config PATH or set SPEEDTRONIC_CONFIG")
    resolved = resolve_config(source, environ=os.environ, overrides=overrides)
    config = resolved.config
    args.secret_values = [config.distributed.token] if config.distributed.token else []
    if args.max_steps is not None and config.effective_max_steps != args.max_steps:
        config.apply_run_target(args.max_steps)  # --max-steps also beats data.max_steps
        resolved.sources["data.max_steps"] = "cli"
    return resolved


def _checkpoint_source(args: argparse.Namespace) -> dict[str, Any] | None:
    """``export``/``sample``/``eval --checkpoint PATH`` without a config: the run config the
    checkpoint carries (redacted: a token comes from HF_TOKEN or a secret file again)."""
    if args.command not in ("export", "sample", "eval") or not getattr(args, "checkpoint", None):
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


def _dump(payload: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(payload, indent=2)
    import yaml

    return yaml.safe_dump(payload, sort_keys=False, allow_unicode=True).rstrip("\n")


def _cmd_validate(args: argparse.Namespace) -> int:
    config = _resolve(args).config
    derived = {
        "accumulation_steps": config.accumulation_steps,
        "effective_max_steps": config.effective_max_steps,
    }
    if args.format == "json":
        print(_dump({"config": config.to_dict(redact_secrets=True), "derived": derived}, "json"))
    else:
        print(config.to_yaml(redact_secrets=True), end="")
        for key, value in derived.items():
            print(f"# {key}: {value}")
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
        line = (
            f"completed steps={result.steps} samples={result.samples} "
            f"tokens={result.tokens} loss={result.final_loss}"
        )
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
        print(" ".join(f"{key}={_text_value(value)}" for key, value in result.items()))
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


def _text_value(value: Any) -> str:
    if value is None:
        return "null"
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
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
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
