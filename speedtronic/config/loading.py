"""What a user writes, read into the canonical mapping the sections are built from.

Reading (:func:`read_source`, 2.0.0's ``load`` heuristic, reference/config.md §2.3): a mapping
as is; a ``str`` with a newline, a leading ``{``/``[``, or a ``:`` that is no existing path is
inline YAML/JSON; anything else a path (``.yaml``/``.yml`` YAML, else JSON). Every YAML
document (files, env, secret and ``--set`` values) goes through one bounded loader: at most
``MAX_DEPTH`` levels and ``MAX_NODES`` nodes with aliases expanded, no alias into itself, no
duplicate key, integers over 40 digits kept as text.

Normalising (:func:`canonicalize`, once, where a mapping enters): the 2.0.0 root and section
aliases, the ``optimizer``/``precision``/``compile`` shorthands, `RETIRED` settings and 2.0.0
log paths under ``run.output_dir``. The canonical form has only section keys and root fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import logging
from collections.abc import Hashable, Iterable, Iterator, Mapping
from pathlib import Path, PurePath

import yaml

from speedtronic.config.limits import MAX_INT_DIGITS, ConfigError, ConfigFileNotFoundError
from speedtronic.config.redaction import REDACTED
from speedtronic.config.sections import RunConfig

__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "RETIRED",
    "ROOT_ALIASES",
    "ROOT_FIELDS",
    "RUN_ALIASES",
    "SECTION_NAMES",
    "canonicalize",
    "closest_name",
    "compile_shorthand",
    "load_yaml_value",
    "looks_inline",
    "read_config_file",
    "read_source",
    "rebase_legacy_log_paths",
    "section_mapping",
    "unknown_keys_message",
    "with_origin",
]

logger = logging.getLogger("speedtronic.config")

MAX_DEPTH = 64  # nesting levels of a document (a config needs four)
MAX_NODES = 100_000  # nodes of a document with every alias expanded


class _Refused(yaml.MarkedYAMLError):
    """A document the bounded loader refuses (too deep, too big, duplicate key)."""

    def __init__(self, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem=problem, problem_mark=mark)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _measure(root: yaml.Node) -> None:
    """Refuse a composed document whose alias expansion is cyclic, too big or too deep.

    An iterative post-order walk over the node graph (aliases share nodes), memoised by
    node, so a 370-byte alias bomb is measured in microseconds without being expanded.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    visiting: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            visiting.discard(key)
            children = _children(node)
            size[key] = 1 + sum(size[id(child)] for child in children)
            depth[key] = 1 + max((depth[id(child)] for child in children), default=0)
            if size[key] > MAX_NODES:
                raise _Refused(
                    f"anchors and aliases expand to more than {MAX_NODES} nodes; refusing the "
                    "document (an alias bomb?)",
                    node.start_mark,
                )
            if depth[key] > MAX_DEPTH:
                raise _Refused(f"nesting deeper than {MAX_DEPTH} levels", node.start_mark)
            continue
        if key in size:
            continue
        visiting.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in visiting:
                raise _Refused("an alias refers to a node that contains it", child.start_mark)
            if id(child) not in size:
                stack.append((child, False))


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that bounds the document before constructing it (see module)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                event = self.peek_event()  # type: ignore[no-untyped-call]  # stubs omit types
                raise _Refused(f"nesting deeper than {MAX_DEPTH} levels", event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _measure(node)
        return node

    def construct_mapping(
        self, node: yaml.MappingNode, deep: bool = False
    ) -> dict[Hashable, object]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                shown = str(key) if len(str(key)) <= 40 else str(key)[:37] + "..."
                raise _Refused(f"duplicate key {shown!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _int_or_text(loader: _BoundedLoader, node: yaml.ScalarNode) -> int | str:
    """A YAML integer; one of more than ``MAX_INT_DIGITS`` digits stays text (the field's own
    check names it; ``int()`` would take quadratic time)."""
    text = str(loader.construct_scalar(node))
    return text if len(text) > MAX_INT_DIGITS else loader.construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _int_or_text)


def load_yaml_value(text: str) -> object:
    """A YAML document through the bounded loader (a refusal is a ``MarkedYAMLError``)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _json_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            shown = key if len(key) <= 40 else key[:37] + "..."
            raise ConfigError(f"duplicate key {shown!r}")
        result[key] = value
    return result


def _json_int(text: str) -> object:
    return int(text) if len(text) <= MAX_INT_DIGITS else text


def _json_depth_ok(value: object) -> bool:
    """True when ``value`` nests at most ``MAX_DEPTH`` levels (iterative walk)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > MAX_DEPTH:
            return False
        if isinstance(item, dict):
            stack.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item)
    return True


def _root_mapping(parsed: object) -> dict[str, object]:
    if not parsed:
        return {}
    if not isinstance(parsed, Mapping):
        raise ConfigError("configuration root must be a mapping")
    return dict(parsed)


def parse_text(text: str, *, origin: str = "<inline>", use_json: bool = False) -> dict[str, object]:
    """Parse YAML (or JSON) text into the root mapping; syntax errors name line and column."""
    if use_json:
        try:
            parsed = json.loads(text, object_pairs_hook=_json_pairs, parse_int=_json_int)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{origin}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from None
        except ConfigError as exc:
            raise ConfigError(f"{origin}: invalid JSON: {exc}") from None
        except RecursionError:
            raise ConfigError(
                f"{origin}: invalid JSON: nesting deeper than {MAX_DEPTH} levels"
            ) from None
        if not _json_depth_ok(parsed):
            raise ConfigError(f"{origin}: invalid JSON: nesting deeper than {MAX_DEPTH} levels")
        return _root_mapping(parsed)
    try:
        parsed = load_yaml_value(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"{origin}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: invalid YAML: {exc}") from None
    return _root_mapping(parsed)


def warn_if_token(values: Mapping[str, object], origin: str) -> None:
    """Log a warning when a mapping read from a file carries a Hub token (value never logged)."""
    for key in ("distributed", "hub", "diloco"):
        section = values.get(key)
        if isinstance(section, Mapping):
            token = section.get("token")
            if token and token != REDACTED:
                logger.warning(
                    "%s sets %s.token; a token in a config file is discouraged, "
                    "use HF_TOKEN or a secret file (SPEEDTRONIC_SECRETS_DIR/hf_token)",
                    origin,
                    key,
                )
                return


def read_config_file(path: str | Path, *, force_yaml: bool = False) -> dict[str, object]:
    """Read a config file: YAML for ``.yaml``/``.yml`` (or ``force_yaml``), else JSON."""
    file_path = Path(path)
    try:
        text = file_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileNotFoundError(f"config file not found: {file_path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, not a file: {file_path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file_path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file_path}: {exc.strerror}") from None
    use_json = not force_yaml and file_path.suffix.lower() not in {".yaml", ".yml"}
    values = parse_text(text, origin=str(file_path), use_json=use_json)
    if not values:
        logger.warning("%s is empty (no settings); every field keeps its default", file_path)
    warn_if_token(values, str(file_path))
    return values


@contextlib.contextmanager
def with_origin(path: str | Path | None) -> Iterator[None]:
    """Name the file in an unknown-key error raised inside: ``data: unknown configuration keys:
    micro_batch_sise in run.yaml (did you mean micro_batch_size?)``."""
    try:
        yield
    except ConfigError as error:
        message = str(error)
        if path is None or "unknown configuration keys" not in message:
            raise
        keys, hint, rest = message.partition(" (did you mean ")
        raise ConfigError(f"{keys} in {path}{hint}{rest}") from None


def looks_inline(source: str) -> bool:
    """The 2.0.0 inline-text heuristic for a ``str`` source."""
    if "\n" in source or source.lstrip().startswith(("{", "[")):
        return True
    if ":" in source:
        try:
            return not Path(source).exists()
        except (OSError, ValueError):
            return True
    return False


def read_source(source: object) -> dict[str, object]:
    """Resolve any ``SpeedtronicConfig.load`` source into a root mapping."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str) and looks_inline(source):
        values = parse_text(source)
        warn_if_token(values, "inline configuration")
        return values
    if not isinstance(source, (str, Path)):
        raise ConfigError(
            f"configuration source must be a mapping, YAML/JSON text or a path, "
            f"got {type(source).__name__}"
        )
    return read_config_file(source)


SECTION_NAMES = (
    "run",
    "model",
    "data",
    "optimizer",
    "scheduler",
    "precision",
    "checkpoint",
    "logging",
    "distributed",
    "shape_validation",
    "metrics",
    "eval",
    "runtime",
)
ROOT_FIELDS = ("gradient_checkpointing", "compile", "ooo_backprop", "ooo_streams")
RUN_ALIASES = ("name", "seed", "device", "output_dir", "max_steps", "log_every")
ROOT_ALIASES = (*RUN_ALIASES, "hub", "diloco", "muon_plus", "cautious")
#: 2.0.0 settings that had one legal value and are gone: (section, key) -> that value.
RETIRED: dict[tuple[str, str], object] = {
    ("distributed", "delta_upload_queue_size"): 1,
    ("distributed", "delta_upload_overflow"): "skip",
}


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The one "did you mean": the most similar of ``choices`` (`difflib`), or None."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_keys_message(
    keys: Iterable[object], prefix: str = "", known: Iterable[str] = ()
) -> str:
    """``[<section>: ]unknown configuration keys: a, b`` (sorted), with ``did you mean``."""
    names = sorted(str(key) for key in keys)
    message = f"{prefix}unknown configuration keys: {', '.join(names)}"
    choices = [str(name) for name in known if name not in names]
    meant = next(filter(None, (closest_name(name, choices) for name in names)), None)
    return f"{message} (did you mean {meant}?)" if meant else message


def section_mapping(
    data: Mapping[str, object], name: str, what: str = "a mapping"
) -> dict[str, object]:
    """Section ``name`` of ``data`` as a dict of its fields (``{}`` when absent or null)."""
    section = data.get(name)
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{name} must be {what}")
    return dict(section)


def canonicalize(values: object) -> dict[str, object]:
    """Apply the 2.0.0 aliases and shorthands (module docstring); section values are left to
    the section classes."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError("configuration root must be a mapping")
    data: dict[str, object] = {str(key): value for key, value in values.items()}
    run = section_mapping(data, "run")
    run.update({alias: data.pop(alias) for alias in RUN_ALIASES if alias in data})
    if run or "run" in data:
        data["run"] = run
    for alias in ("hub", "diloco"):
        if alias in data and "distributed" not in data:
            data["distributed"] = data.pop(alias)
    if isinstance(data.get("optimizer"), str):
        data["optimizer"] = {"name": data["optimizer"]}
    for flag in ("muon_plus", "cautious"):
        if flag in data:
            optimizer = section_mapping(data, "optimizer", "a mapping or optimizer name string")
            value = data.pop(flag)
            if flag in optimizer and optimizer[flag] != value:
                raise ConfigError(f"conflicting optimizer.{flag} values")
            data["optimizer"] = {**optimizer, flag: value}
    if isinstance(data.get("precision"), str):
        data["precision"] = {"mode": data["precision"]}
    unknown = set(data) - set(SECTION_NAMES) - set(ROOT_FIELDS)
    if unknown:
        raise ConfigError(unknown_keys_message(unknown, "", (*SECTION_NAMES, *ROOT_ALIASES)))
    if "compile" in data:
        data["compile"] = compile_shorthand(data["compile"])
    for (name, key), legal in RETIRED.items():
        section = data.get(name)
        if isinstance(section, Mapping) and key in section:
            value = section[key]
            text = value.strip().lower() if isinstance(value, str) else None
            if isinstance(value, bool) or (text != str(legal) and value != legal):
                raise ConfigError(f"{name}.{key} is retired: it must be {legal} or absent")
            data[name] = {k: v for k, v in section.items() if k != key}
            logger.warning("%s.%s is retired; the setting is ignored, remove it", name, key)
    rebase_legacy_log_paths(data)
    return data


def compile_shorthand(value: object) -> object:
    """The 2.0.0 ``compile: {enabled: x}`` form -> ``x`` (``{}`` -> False); other values as is."""
    if not isinstance(value, Mapping):
        return value
    extra = set(value) - {"enabled"}
    if extra:
        raise ConfigError(unknown_keys_message(extra, "compile: "))
    return value.get("enabled", False)


def rebase_legacy_log_paths(data: dict[str, object]) -> None:
    """A 2.0.0 log path that spells ``run.output_dir`` out (``runs/smoke/events.jsonl``) loses
    that prefix, with a warning: since 2.1 ``logging.file``/``json_file`` are relative to it."""
    section = data.get("logging")
    run = data.get("run")
    output_dir = run.get("output_dir") if isinstance(run, Mapping) else None
    output_dir = RunConfig().output_dir if output_dir is None else output_dir
    if not isinstance(section, Mapping) or not isinstance(output_dir, str):
        return
    prefix = PurePath(output_dir).parts
    if not prefix or PurePath(output_dir).is_absolute():
        return
    rebased = dict(section)
    for key in ("file", "json_file"):
        value = section.get(key)
        parts = PurePath(value).parts if isinstance(value, str) else ()
        if len(parts) <= len(prefix) or parts[: len(prefix)] != prefix:
            continue
        rebased[key] = str(PurePath(*parts[len(prefix) :]))
        logger.warning(
            "logging.%s: %s is read as %s below run.output_dir (log paths are relative to "
            "run.output_dir since 2.1); write %s to keep this meaning",
            key,
            value,
            rebased[key],
            rebased[key],
        )
    data["logging"] = rebased
