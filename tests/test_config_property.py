"""Property tests: any input is either a valid config or a ConfigError — nothing else escapes."""

from __future__ import annotations

import dataclasses

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speedtronic.config import ConfigError, SpeedtronicConfig, load_config, resolve_config
from speedtronic.config.layering import env_name_for, known_fields
from speedtronic.config.loading import ROOT_ALIASES, ROOT_FIELDS
from speedtronic.config.schema import SECTION_CLASSES

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["true", "no", "3e-4", "1", "0", "auto", "muon", "bf16", "null", "8", ""]),
    st.integers(min_value=1, max_value=64),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _section(name: str) -> st.SearchStrategy:
    fields = [f.name for f in dataclasses.fields(SECTION_CLASSES[name])]
    keys = st.one_of(st.sampled_from(fields), st.text(max_size=8))
    return st.one_of(
        st.none(),
        st.dictionaries(keys, VALUES, max_size=4),
        SCALARS,
    )


ROOT_KEYS = st.sampled_from([*SECTION_CLASSES, *ROOT_FIELDS, *ROOT_ALIASES, "bogus"])
SECTIONS = st.fixed_dictionaries({}, optional={name: _section(name) for name in SECTION_CLASSES})
MAPPINGS = st.tuples(st.dictionaries(ROOT_KEYS, VALUES, max_size=4), SECTIONS).map(
    lambda pair: {**pair[0], **pair[1]}
)


def _check(build) -> None:
    try:
        config = build()
    except ConfigError:
        return
    assert isinstance(config, SpeedtronicConfig)
    # a valid config serialises and reloads to the same thing
    data = config.to_dict()
    if not isinstance(config.data.dataset, (str, type(None))):
        return
    assert SpeedtronicConfig.from_dict(data).to_dict() == data
    yaml.safe_dump(config.to_dict(redact_secrets=True))


@SETTINGS
@given(st.dictionaries(ROOT_KEYS, VALUES, max_size=6))
def test_random_root_mappings(values) -> None:
    _check(lambda: SpeedtronicConfig.from_dict(values))


@SETTINGS
@given(SECTIONS)
def test_random_section_mappings(values) -> None:
    _check(lambda: SpeedtronicConfig.from_dict(values))


ENV_NAMES = st.one_of(
    st.sampled_from(sorted(env_name_for(dotted) for dotted in known_fields())),
    st.sampled_from(["HF_TOKEN", "SPEEDTRONIC_NODE_ID", "SPEEDTRONIC_FOO", "PATH"]),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=10).map(
        lambda s: "SPEEDTRONIC_" + s
    ),
)
ENV_VALUES = st.one_of(
    st.text(max_size=16),
    st.sampled_from(["[0.9, 0.95]", "{a: 1}", "[1,", "7", "-3", "yes", "3e-4", "null", "~"]),
)


@SETTINGS
@given(st.dictionaries(ENV_NAMES, ENV_VALUES, max_size=4))
def test_random_environment(environ) -> None:
    environ = {k: v for k, v in environ.items() if "\x00" not in k + v}
    _check(
        lambda: (
            resolve_config(
                {"max_steps": 3}, environ=environ, secrets_dir="/nonexistent-speedtronic"
            ).config
        )
    )


@SETTINGS
@given(st.one_of(st.text(max_size=80), VALUES.map(lambda v: yaml.safe_dump({"run": v}))))
def test_random_yaml_text(text) -> None:
    _check(lambda: load_config(text if "\n" in text else text + "\n"))


@SETTINGS
@given(MAPPINGS.map(lambda m: yaml.safe_dump(m, default_flow_style=None)))
def test_random_yaml_documents(text) -> None:
    _check(lambda: load_config(text + "\n"))


@SETTINGS
@given(
    st.lists(
        st.tuples(
            st.sampled_from([*known_fields(), "max_steps", "optimizer", "bogus", "run.x"]),
            ENV_VALUES,
        ),
        max_size=3,
    )
)
def test_random_overrides(pairs) -> None:
    overrides = [f"{key}={value}" for key, value in pairs]
    _check(
        lambda: (
            resolve_config(
                {}, environ={}, secrets_dir="/nonexistent-speedtronic", overrides=overrides
            ).config
        )
    )
