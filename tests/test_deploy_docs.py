"""docs/deploy.md and docs/grafana-dashboard.json agree with the code and the manifests."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess

import pytest
import yaml
from test_deploy_support import REPO

from speedtronic.config import SpeedtronicConfig
from speedtronic.metrics.prometheus import SERIES

DOC = (REPO / "docs/deploy.md").read_text()
DASHBOARD = json.loads((REPO / "docs/grafana-dashboard.json").read_text())
_SUFFIXES = ("_bucket", "_sum", "_count")


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in SERIES:
            return name[: -len(suffix)]
    return name


def _exprs() -> list[str]:
    return [target["expr"] for panel in DASHBOARD["panels"] for target in panel.get("targets", [])]


def test_every_series_is_documented_and_nothing_else():
    documented = set(re.findall(r"`(speedtronic_[a-z_]+)", DOC))
    assert set(SERIES) <= documented, set(SERIES) - documented
    assert {_base(n) for n in documented} <= set(SERIES), documented - set(SERIES)


def test_dashboard_queries_only_documented_series_and_covers_the_key_ones():
    used = {_base(n) for e in _exprs() for n in re.findall(r"speedtronic_[a-z_]+", e)}
    assert used <= set(SERIES), used - set(SERIES)
    key = {
        "speedtronic_train_steps_total",
        "speedtronic_train_loss",
        "speedtronic_train_tokens_total",
        "speedtronic_train_step_seconds",
        "speedtronic_diloco_outer_step",
        "speedtronic_diloco_deltas_included_total",
        "speedtronic_diloco_uploads_total",
        "speedtronic_diloco_global_pulls_total",
        "speedtronic_diloco_seconds_since_last_global_sync",
    }
    assert key <= used, key - used
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert DASHBOARD["uid"] and DASHBOARD["title"]


def test_documented_variables_name_real_config_fields():
    fields = SpeedtronicConfig().to_dict()
    for name in set(re.findall(r"SPEEDTRONIC_([A-Z]+)__([A-Z_]+)", DOC)):
        section, field = name[0].lower(), name[1].lower()
        assert section in fields and field in fields[section], name


def test_documented_files_exist():
    for path in re.findall(r"`((?:k8s|deploy|configs|docs)/[\w./-]+|compose[\w.]*\.yaml)`", DOC):
        if "<" not in path and path != "compose.override.yaml":  # the user's own file
            assert (REPO / path.rstrip("/")).exists(), path


def test_dashboard_promql_parses(tmp_path):
    """Every dashboard query is valid PromQL (checked by promtool when it is installed)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus, .ci/install-tools)")
    rules = []
    for index, expr in enumerate(_exprs()):
        concrete = expr.replace("$__rate_interval", "5m").replace("$role", ".*")
        rules.append(
            {"record": f"dashboard:query_{index}", "expr": concrete.replace("$node_id", ".*")}
        )
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_container_commands_in_the_docs_name_real_files_services_and_profiles():
    """Every `docker compose` line in README.md and docs/deploy.md names compose files,
    services and profiles that exist."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    services = set(compose["services"])
    profiles = {p for s in compose["services"].values() for p in s.get("profiles", [])}
    readme = (REPO / "README.md").read_text()
    lines = [
        line.split("#")[0]
        for text in (readme, DOC)
        for line in text.splitlines()
        if line.strip().startswith(("docker compose", "SPEEDTRONIC_HUB_REPO"))
        or " docker compose " in line
    ]
    assert lines
    for line in lines:
        words = line.replace("\\", " ").split()
        for flag, value in itertools.pairwise(words):
            if flag == "-f" and value.endswith(".yaml"):
                assert (REPO / value).is_file(), line
            if flag == "--profile":
                assert value in profiles, line
        if " up" in line:
            tail = words[words.index("up") + 1 :]
            named = [w for w in tail if not w.startswith("-") and "=" not in w]
            assert set(named) <= services, line
