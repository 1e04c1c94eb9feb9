"""Helpers shared by the deploy tests: Dockerfile, compose and kustomize parsing.

The process side of the rehearsals lives in tests/test_rehearsal_support.py.
The module also holds a few self-checks of the helpers (collected as tests).
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


# -- Dockerfile --------------------------------------------------------------------------------
def dockerfile_instructions(path: Path = REPO / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs with line continuations joined and comments dropped."""
    lines: list[str] = []
    buffer = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or (stripped.startswith("#") and not buffer):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        lines.append(buffer + stripped)
        buffer = ""
    out = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Instructions of the last build stage (from its FROM on)."""
    last = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last:]


def image_config() -> dict[str, Any]:
    """ENTRYPOINT, CMD, ENV, WORKDIR and USER of the final stage of the Dockerfile."""
    stage = final_stage(dockerfile_instructions())
    config: dict[str, Any] = {"env": {}, "entrypoint": [], "cmd": [], "workdir": "/", "user": ""}
    for keyword, argument in stage:
        if keyword == "ENV":
            for token in shlex.split(argument):
                key, _, value = token.partition("=")
                config["env"][key] = value
        elif keyword in ("ENTRYPOINT", "CMD"):
            config[keyword.lower()] = json.loads(argument)
        elif keyword == "WORKDIR":
            config["workdir"] = argument
        elif keyword == "USER":
            config["user"] = argument
    return config


# -- compose -----------------------------------------------------------------------------------
_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, environ: Mapping[str, str]) -> Any:
    """Compose variable interpolation: ``${VAR}``, ``${VAR:-default}``, ``${VAR:?err}``, ``$$``."""
    if isinstance(value, dict):
        return {key: interpolate(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, environ) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = match.group(1), match.group(2), match.group(3)
        current = environ.get(name)
        if operator in (":-", "-"):
            unset = current is None or (operator == ":-" and current == "")
            return argument if unset else current
        if operator in (":?", "?"):
            if current is None or (operator == ":?" and current == ""):
                raise ValueError(f"compose: required variable {name} is missing: {argument}")
            return current
        return current or ""

    return _INTERPOLATION.sub(replace, value)


def merge_compose(base: dict, override: dict) -> dict:
    """Merge an override file into a compose model (mappings merge, sequences extend)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_compose(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = [*out[key], *[item for item in value if item not in out[key]]]
        else:
            out[key] = value
    return out


def load_compose(*names: str, environ: Mapping[str, str] | None = None) -> dict:
    """Parse compose files (YAML anchors and merge keys resolved), merged and interpolated."""
    model: dict = {}
    for name in names or ("compose.yaml",):
        model = merge_compose(model, yaml.safe_load((REPO / name).read_text()))
    return interpolate(model, environ if environ is not None else {})


def compose_env(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or list form) as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


# -- kustomize ---------------------------------------------------------------------------------
_KUSTOMIZE_MIN = (4, 5)  # `labels:` with includeSelectors and `patches:` with targets


def _kustomize_version(argv: list[str]) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"v(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


@functools.lru_cache(maxsize=1)
def kustomize_status() -> tuple[list[str] | None, str]:
    """(render command, why not) for the installed kustomize: `kubectl kustomize` or
    `kustomize build`, version >= 4.5; (None, reason) when neither is usable."""
    found = []
    if shutil.which("kubectl"):
        raw = subprocess.run(
            ["kubectl", "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
        try:
            text = json.loads(raw).get("kustomizeVersion", "")
        except ValueError:
            text = ""
        version = _kustomize_version(["echo", text]) if text else None
        if version is not None and version >= _KUSTOMIZE_MIN:
            return ["kubectl", "kustomize"], ""
        found.append(f"kubectl with kustomize {text or 'unknown (too old)'}")
    if shutil.which("kustomize"):
        version = _kustomize_version(["kustomize", "version"])
        if version is not None and version >= _KUSTOMIZE_MIN:
            return ["kustomize", "build"], ""
        found.append(f"kustomize {version}")
    if not found:
        return (
            None,
            "neither kubectl nor kustomize is installed (.ci/install-tools installs kubectl)",
        )
    return None, f"kustomize >= v4.5 needed, found: {'; '.join(found)}"


def kustomize_command() -> list[str] | None:
    """The command that renders a kustomization with a recent enough kustomize, or None."""
    return kustomize_status()[0]


def render_kustomize(directory: str) -> list[dict]:
    """Render `k8s/<directory>` with the installed kustomize; the objects as dicts."""
    command = kustomize_command()
    assert command is not None, "no kubectl/kustomize"
    result = subprocess.run(
        [*command, str(REPO / directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: Iterable[dict], kind: str, name: str | None = None) -> dict:
    """The one object of `kind` (and `name`)."""
    matches = [
        obj
        for obj in objects
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, (kind, name, [m["metadata"]["name"] for m in matches])
    return matches[0]


_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def k8s_env(container: Mapping[str, Any], pod_name: str) -> dict[str, str]:
    """A container's env as Kubernetes sets it: fieldRefs and ``$(VAR)`` expansion in order."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            value = _K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
        else:
            ref = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == "metadata.name", f"rehearsal does not map fieldRef {ref}"
            value = pod_name
        env[item["name"]] = value
    return env


# -- self-checks -------------------------------------------------------------------------------
def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("a$$b ${SET} ${NOPE:-d} ${EMPTY:-e} ${EMPTY-f}", env) == "a$b x d e "
    try:
        interpolate("${NOPE:?give it}", env)
    except ValueError as exc:
        assert "NOPE" in str(exc)
    else:
        raise AssertionError("missing required variable accepted")


def test_k8s_env_expands_field_refs_and_dependent_variables():
    container = {
        "env": [
            {"name": "ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "OUT", "value": "/data/runs/$(ID)"},
            {"name": "KEEP", "value": "$(UNDEFINED)"},
        ]
    }
    assert k8s_env(container, "pod-7") == {
        "ID": "pod-7",
        "OUT": "/data/runs/pod-7",
        "KEEP": "$(UNDEFINED)",
    }
