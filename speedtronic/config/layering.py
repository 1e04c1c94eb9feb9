"""Layered configuration: defaults < file < secret files < environment < CLI overrides.

:func:`resolve_config` is the one place that reads the environment and the secrets directory
(pydantic-settings' ``EnvSettingsSource`` for ``SPEEDTRONIC_<SECTION>__<FIELD>``). Ours, because
the library lacks them: per-field provenance (``file``, ``env:<NAME>``, ``secret:<file>``,
``cli``), the origin in an error, "did you mean" for unknown ``SPEEDTRONIC_*`` names and near
misses of the prefix, and secrets kept out of every error (:class:`SecretText`; the token is
refused in other fields and on the command line).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from speedtronic.config.limits import ConfigError
from speedtronic.config.loading import (
    ROOT_FIELDS,
    SECTION_NAMES,
    canonicalize,
    closest_name,
    compile_shorthand,
    load_yaml_value,
    looks_inline,
    read_source,
    rebase_legacy_log_paths,
    section_mapping,
    with_origin,
)
from speedtronic.config.redaction import SecretText, holds_secret, scrub, strings
from speedtronic.config.schema import SpeedtronicConfig, field_infos
from speedtronic.config.secret_files import read_secret_files

__all__ = [
    "DEFAULT_SECRETS_DIR",
    "ENV_PREFIX",
    "EXTRA_ENV_NAMES",
    "ResolvedConfig",
    "closest_env_name",
    "env_name_for",
    "known_fields",
    "resolve_config",
    "travelling",
]

logger = logging.getLogger("speedtronic.config")
ENV_PREFIX = "SPEEDTRONIC_"
DEFAULT_SECRETS_DIR = "/run/secrets"
TOKEN_KEY = "distributed.token"
NODE_ID_KEY = "distributed.node_id"
HF_TOKEN_FILE = "hf_token"
Layer = list[tuple[str, object, str]]  # (dotted field, value, source), lowest precedence first
#: ``SPEEDTRONIC_*`` names that are not fields but are understood: ours, then compose.yaml's
#: interpolation variables (a shell that exports them for ``docker compose`` must still run us).
_ENV_SUGGESTIONS = ("SPEEDTRONIC_CONFIG", "SPEEDTRONIC_SECRETS_DIR", "SPEEDTRONIC_NODE_ID")
_COMPOSE = ("IMAGE", "HUB_REPO", "HF_TOKEN_FILE", "BIND_ADDRESS", "MASTER_PORT", "CPUS", "MEMORY")
EXTRA_ENV_NAMES = frozenset(_ENV_SUGGESTIONS + tuple(ENV_PREFIX + name for name in _COMPOSE))
#: Fields that make a command run code (unpickling), reach out (a remote ``init_from``, a
#: tracker) or publish: only the user's own layers set them, never a config that travels with
#: a checkpoint (:func:`travelling`).
USER_ONLY = ("data.allow_pickle", "model.init_from", "run.push_to_hub", "logging.trackers")


@dataclass
class ResolvedConfig:
    """The merged config plus the origin of every value that did not come from a default."""

    config: SpeedtronicConfig
    sources: dict[str, str] = field(default_factory=dict)
    config_path: str | None = None


@functools.cache
def known_fields() -> dict[str, bool]:
    """Every dotted field name -> True when it is a string field (takes raw env text)."""

    def plain(kind: object) -> object:
        return typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind

    text = {str, type(None)}
    return {
        dotted: info.annotation is str
        or {plain(a) for a in typing.get_args(info.annotation)} == text
        for dotted, info in field_infos().items()
    }


def env_name_for(dotted: str) -> str:
    """``run.max_steps`` -> ``SPEEDTRONIC_RUN__MAX_STEPS``; root fields have no section part."""
    return ENV_PREFIX + dotted.replace(".", "__").upper()


@functools.cache
def _env_fields() -> dict[str, str]:
    """``SPEEDTRONIC_*`` name (upper case) -> dotted field, in field order."""
    return {env_name_for(dotted): dotted for dotted in known_fields()}


@functools.cache
def _secret_fields() -> dict[str, str]:
    """Secret file name (lower case) -> dotted field: ``hf_token`` and ``<section>__<field>``."""
    names = {HF_TOKEN_FILE: HF_TOKEN_FILE}  # -> distributed.token, below distributed__token
    names.update({dotted.replace(".", "__"): dotted for dotted in known_fields()})
    return names


def _parse_value(raw: object, dotted: str, origin: str) -> object:
    """YAML-parse a text value unless the field is a string field (raw text kept)."""
    if not isinstance(raw, str):
        return raw
    if dotted == TOKEN_KEY:
        return SecretText(raw)
    is_str = known_fields().get(dotted, False)
    if is_str:
        return None if raw.strip() in {"null", "~"} else raw
    try:
        return load_yaml_value(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{origin}: cannot parse value for {dotted}: {problem}") from None


def _secret(value: object) -> object:
    """Mark every string in a value read from a secret file (lists and mappings included)."""
    if isinstance(value, str):
        return SecretText(value)
    if isinstance(value, list):
        return [_secret(item) for item in value]
    if isinstance(value, dict):
        return {key: _secret(item) for key, item in value.items()}
    return value


def _flatten(values: Mapping[str, object]) -> dict[str, object]:
    """Canonical nested mapping -> dotted keys (sections must be mappings or null)."""
    flat: dict[str, object] = {}
    for key, value in values.items():
        if key in SECTION_NAMES:
            for name, item in section_mapping(values, key).items():
                flat[f"{key}.{name}"] = item
        else:
            flat[key] = value
    return flat


def _put(nested: dict[str, object], dotted: str, value: object) -> None:
    """Set field ``dotted`` (``section.field`` or a root field) in a canonical nested mapping."""
    section, _, name = dotted.partition(".")
    if name:
        fields = nested.setdefault(section, {})
        assert isinstance(fields, dict)  # only this function fills ``nested``
        fields[name] = value
    else:
        nested[dotted] = value


def closest_field(key: str, extra: Iterable[str] = ()) -> str | None:
    """The dotted field (or one of ``extra``) an unknown ``key`` most likely meant, or None.

    ``key`` is ``section.field`` or ``section__field`` in any case. A 2.0.0 section alias gets
    its section (``hub.repo_id``); then the most similar name, if one is similar enough; then a
    field of the same name in another section (``run`` first: ``max_steps``, ``run.lr``).
    """
    key = key.strip().lower().replace("__", ".")
    fields = list(known_fields())
    section, _, leaf = key.rpartition(".")
    if section in ("hub", "diloco") and f"distributed.{leaf}" in fields:
        return f"distributed.{leaf}"
    meant = closest_name(key, [*fields, *extra]) if section else None
    same_leaf = sorted(
        (d for d in fields if d.endswith(f".{leaf}")), key=lambda d: d != f"run.{leaf}"
    )
    return meant or (same_leaf[0] if same_leaf else closest_name(key, [*fields, *extra]))


def closest_env_name(name: str) -> str | None:
    """The known ``SPEEDTRONIC_*`` name an unknown ``name`` most likely meant, or None."""
    upper = name.upper()
    rest = upper[len(ENV_PREFIX) :] if upper.startswith(ENV_PREFIX) else upper
    extra = [known[len(ENV_PREFIX) :].lower() for known in _ENV_SUGGESTIONS]
    meant = closest_field(rest, extra)
    return None if meant is None else env_name_for(meant)


def _misspelt_prefix(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` meant when it is ``<near miss of SPEEDTRONIC><field suffix>``
    (the suffix may have one ``_`` between section and field: ``SPEEDTONIC_RUN_MAX_STEPS``).
    Prefixes at least 0.8 alike count (``SPEEDTONIC`` 0.95; ``SPEEDTEST`` 0.6 does not)."""
    upper = name.upper()
    if upper.startswith(ENV_PREFIX):
        return None
    suffixes = {full[len(ENV_PREFIX) :]: full for full in known}
    suffixes.update({s.replace("__", "_"): full for s, full in list(suffixes.items())})
    for suffix in sorted(suffixes, key=len, reverse=True):  # the longest field name first
        if upper.endswith(suffix) and len(upper) > len(suffix):
            head = upper[: -len(suffix)].rstrip("_-").replace("_", "")
            if difflib.SequenceMatcher(None, head, ENV_PREFIX.rstrip("_")).ratio() >= 0.8:
                return suffixes[suffix]
    return None


def _check_env_names(environ: Mapping[str, str]) -> None:
    """Refuse unknown ``SPEEDTRONIC_*`` names and near misses of the prefix before a field
    (typos must not be ignored silently), naming the closest known name."""
    known = {env_name_for(dotted) for dotted in known_fields()} | EXTRA_ENV_NAMES
    for name in sorted(environ):
        meant = _misspelt_prefix(name, known)
        if meant is not None:
            raise ConfigError(
                f"unknown environment variable {name}: its prefix is not {ENV_PREFIX}, so it "
                f"sets nothing (did you mean {meant}?)"
            )
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in known:
            continue
        suggestion = closest_env_name(name)
        hint = f" (did you mean {suggestion}?)" if suggestion else ""
        raise ConfigError(
            f"unknown environment variable {name}: not a configuration field; expected "
            f"SPEEDTRONIC_<SECTION>__<FIELD>{hint}"
        )


@functools.cache
def _env_source_class() -> type:
    """pydantic-settings' environment source over the config tree's names, reading the
    ``environ`` given; each section comes back as a mapping of raw text (imported on first use).
    """
    from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

    # names only: the values stay raw text for _parse_value and the sections to check
    fields: dict[str, object] = {name: dict[str, object] for name in SECTION_NAMES}
    fields.update({name: object for name in ROOT_FIELDS})
    namespace: dict[str, object] = {name: None for name in fields}
    namespace["__annotations__"] = fields
    namespace["model_config"] = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False, extra="ignore"
    )
    names = typing.cast("type[BaseSettings]", type("ConfigNames", (BaseSettings,), namespace))

    class MappingEnvSource(EnvSettingsSource):
        def __init__(self, environ: Mapping[str, str]) -> None:
            self.environ = environ
            super().__init__(names)

        def _load_env_vars(self) -> Mapping[str, str | None]:
            return {key.lower(): value for key, value in self.environ.items()}

    return MappingEnvSource


def _env_layer(environ: Mapping[str, str]) -> Layer:
    """The environment's values; ``HF_TOKEN``/``SPEEDTRONIC_NODE_ID`` below the fields' names."""
    triples: Layer = []
    if environ.get("HF_TOKEN"):
        triples.append((TOKEN_KEY, SecretText(environ["HF_TOKEN"]), "env:HF_TOKEN"))
    names = {name.upper(): name for name in environ}
    node_id = names.get("SPEEDTRONIC_NODE_ID")
    if node_id is not None and environ[node_id].strip():
        triples.append((NODE_ID_KEY, environ[node_id], f"env:{node_id}"))
    if not any(upper in _env_fields() for upper in names):
        return triples
    values = _env_source_class()(environ)()
    for dotted, raw in _flatten(values).items():
        name = names.get(env_name_for(dotted))
        if name is not None and raw is not None:
            origin = f"env:{name}"
            triples.append((dotted, _parse_value(raw, dotted, origin), origin))
    return triples


def _secret_layer(secrets_dir: Path) -> Layer:
    """The secret files' values (:class:`SecretText`); ``hf_token`` below ``distributed__token``."""
    if not secrets_dir.exists():
        return []
    if not secrets_dir.is_dir():
        raise ConfigError(f"secrets directory is not a directory: {secrets_dir}")
    files = read_secret_files(secrets_dir, _secret_fields())
    triples: Layer = []
    name, token = files.pop(HF_TOKEN_FILE, ("", ""))
    if token:
        triples.append((TOKEN_KEY, SecretText(token), f"secret:{name}"))
    for dotted in known_fields():
        if dotted in files:
            name, text = files[dotted]
            origin = f"secret:{name}"
            triples.append((dotted, _secret(_parse_value(text, dotted, origin)), origin))
    return triples


def _override_layer(overrides: Iterable[str] | Mapping[str, object]) -> Layer:
    """``section.field=value`` strings (or a mapping of dotted keys) from the command line."""
    items: Iterable[tuple[str, object]]
    if isinstance(overrides, Mapping):
        items = overrides.items()
    else:
        pairs: list[tuple[str, object]] = []
        for entry in overrides:
            name, sep, text = str(entry).partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"invalid override {entry!r}: expected section.field=value")
            pairs.append((name.strip(), text))
        items = pairs
    canonical: dict[str, object] = {}
    for key, value in items:
        dotted = key if key in known_fields() else None
        if dotted is None:
            aliased = {} if "." in key else _flatten(canonicalize({key: value}))
            if not aliased:
                meant = closest_field(key)
                hint = f" (did you mean {meant}?)" if meant else ""
                raise ConfigError(f"invalid override {key!r}: unknown configuration field{hint}")
            dotted = next(iter(aliased))
        if dotted == TOKEN_KEY:
            raise ConfigError(
                "distributed.token cannot be set with --set: a token on the command line is "
                "visible in the process list; use HF_TOKEN or the hf_token secret file "
                "(SPEEDTRONIC_SECRETS_DIR/hf_token)"
            )
        canonical[dotted] = _parse_value(value, dotted, f"override {key}")
    return [(dotted, value, "cli") for dotted, value in canonical.items()]


def travelling(values: object, origin: str) -> dict[str, object]:
    """A config that came with a checkpoint (``origin`` names it), as a command may use it:
    canonical, without the `USER_ONLY` fields; those it set to other than their defaults are
    named in one warning. Paths it names stay: they are data (read, never executed)."""
    canonical = canonicalize(values)
    ignored = []
    for dotted in USER_ONLY:
        section, _, name = dotted.partition(".")
        part = canonical.get(section)
        if isinstance(part, dict) and name in part:
            part = canonical[section] = dict(part)
            if part.pop(name) != field_infos()[dotted].get_default(call_default_factory=True):
                ignored.append(dotted)
    if ignored:
        logger.warning(
            "%s: ignored %s: a checkpoint's config cannot set what runs code, reaches out or "
            "publishes; set it with --config, the environment or --set",
            origin,
            ", ".join(ignored),
        )
    return canonical


def _attribute(
    error: ConfigError, sources: Mapping[str, str], config_path: str | None
) -> ConfigError:
    """``error`` with the origin of the field it names, when known."""
    message = str(error)
    for dotted in sorted(sources, key=len, reverse=True):
        if message.startswith(dotted):
            origin = sources[dotted]
            if origin == "file":
                origin = config_path or ""
            return ConfigError(f"{message} (from {origin})") if origin else error
    return error


def _refuse_token_elsewhere(merged: Mapping[str, object], tokens: list[str]) -> None:
    """A field other than ``distributed.token`` whose value is the token, in any case, or
    contains it is a ``ConfigError`` that does not show it: a choice field would echo it
    lowercased, and a name (tracker run, directory) would carry it into file names."""
    if not tokens:
        return
    for dotted, value in _flatten(merged).items():
        if dotted != TOKEN_KEY and any(holds_secret(text, tokens) for text in strings(value)):
            raise ConfigError(
                f"{dotted} holds the value of distributed.token (not shown); the token belongs "
                "in HF_TOKEN or the hf_token secret file only"
            )


def resolve_config(
    source: object = None,
    *,
    environ: Mapping[str, str] | None = None,
    secrets_dir: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] | Mapping[str, object] = (),
) -> ResolvedConfig:
    """Merge defaults < ``source`` < secret files < environment < ``overrides``.

    ``source``: path, inline YAML/JSON, mapping, or None (then ``SPEEDTRONIC_CONFIG``; if that is
    unset too, defaults only). ``environ``: defaults to ``os.environ``. ``secrets_dir``: defaults
    to ``SPEEDTRONIC_SECRETS_DIR`` or ``/run/secrets``; a missing directory is fine.
    ``overrides``: ``["run.max_steps=7", ...]`` or ``{"run.max_steps": 7}``.
    """
    env = dict(os.environ if environ is None else environ)
    _check_env_names(env)
    config_path: str | None = None
    if source is None and env.get("SPEEDTRONIC_CONFIG"):
        source = env["SPEEDTRONIC_CONFIG"]
    if isinstance(source, Path) or (isinstance(source, str) and not looks_inline(source)):
        config_path = str(source)
    with with_origin(config_path):
        file_values = canonicalize(read_source(source)) if source is not None else {}
    if secrets_dir is None:
        secrets_dir = env.get("SPEEDTRONIC_SECRETS_DIR") or DEFAULT_SECRETS_DIR

    file_layer = [(dotted, value, "file") for dotted, value in _flatten(file_values).items()]
    layers = (
        file_layer,
        _secret_layer(Path(secrets_dir)),
        _env_layer(env),
        _override_layer(overrides),
    )
    merged: dict[str, object] = {}  # canonical nested mapping, built field by field
    sources: dict[str, str] = {}
    tokens: list[str] = []
    for layer in layers:
        for dotted, value, origin in layer:
            if dotted == TOKEN_KEY and isinstance(value, str):
                value = SecretText(value)  # from the file; the other layers mark it already
                tokens.append(value)
            _put(merged, dotted, value)
            sources[dotted] = origin
    try:
        if "compile" in merged:
            merged["compile"] = compile_shorthand(merged["compile"])
        rebase_legacy_log_paths(merged)  # against the merged run.output_dir (configuration.md)
        with with_origin(config_path):  # an unknown key can only come from the file
            config = SpeedtronicConfig.from_canonical(merged)
        _refuse_token_elsewhere(merged, tokens)  # a value that passed, or one it changed
    except ConfigError as error:
        error = _attribute(error, sources, config_path)
        raise ConfigError(scrub(str(error), tokens)) from None
    order = {dotted: index for index, dotted in enumerate(known_fields())}
    ordered = dict(sorted(sources.items(), key=lambda item: order.get(item[0], len(order))))
    return ResolvedConfig(config=config, sources=ordered, config_path=config_path)
