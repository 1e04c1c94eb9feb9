"""docs/deploy.md "Your data in, your model out" (issue 29): the compose override it shows is
valid compose and, merged over compose.yaml, gives the services a config that reads the data
from the volume; the helper pod it shows is a valid, locked-down Pod on the data claim."""

from __future__ import annotations

import re

import kubernetes_validate
import yaml
from test_deploy_compose import schema_errors
from test_deploy_support import REPO, compose_env, load_compose, merge_compose
from tokenizer_fixtures import word_level

from speedtronic.config import resolve_config

DOC = (REPO / "docs" / "deploy.md").read_text()
SECTION = DOC.split("## Your data in, your model out", 1)[1].split("\n## ", 1)[0]
K8S_VERSION = "1.31.0"


def _block(language: str, first_line: str) -> str:
    for code in re.findall(rf"```{language}\n(.*?)```", SECTION, re.S):
        if code.startswith(first_line):
            return code
    raise AssertionError(f"no {language} block starting with {first_line!r}")


def test_the_override_points_both_services_at_the_volume(tmp_path):
    override = yaml.safe_load(_block("yaml", "# compose.override.yaml"))
    model = merge_compose(load_compose(), override)
    assert not schema_errors(model)
    tokenizer = word_level(tmp_path / "tokenizer.json", 1024)  # stands in for the volume's
    for name in ("master", "worker"):
        env = compose_env(model["services"][name])
        config_file = REPO / "configs" / env["SPEEDTRONIC_CONFIG"].removeprefix("/config/")
        assert env["SPEEDTRONIC_DATA__TOKENIZER"] == "/data/tokenizer.json"
        env.update(SPEEDTRONIC_NODE_ID=name, SPEEDTRONIC_DATA__TOKENIZER=str(tokenizer))
        config = resolve_config(config_file, environ=env, secrets_dir=REPO / "no-such-dir").config
        assert config.data.token_path == config.eval.token_path == "/data/tokens"
        assert config.model.vocab_size == 1024 and config.eval.holdout == 0
        assert config.distributed.repo_id == "file:///data/exchange"  # compose.yaml's, kept


def test_the_helper_pod_is_valid_and_mounts_the_claim():
    text = _block("bash", "cat > files-pod.yaml")
    pod = yaml.safe_load(text.split("<<'POD'\n", 1)[1].split("\nPOD\n", 1)[0])
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    claim = pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    pvc = yaml.safe_load((REPO / "k8s" / "base" / "pvc.yaml").read_text())
    assert claim == pvc["metadata"]["name"]
    (container,) = pod["spec"]["containers"]
    assert container["volumeMounts"][0]["mountPath"] == "/data"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001
    assert "kubectl -n speedtronic apply -f files-pod.yaml" in text


def test_the_paths_it_copies_are_where_the_services_write():
    master = compose_env(load_compose()["services"]["master"])
    final = f"{master['SPEEDTRONIC_RUN__OUTPUT_DIR']}/final"
    assert f"-C {master['SPEEDTRONIC_RUN__OUTPUT_DIR']} -cf - final" in SECTION
    assert f"speedtronic-files:{final} ./final" in SECTION
    k8s_master = (REPO / "k8s" / "base" / "master.yaml").read_text()
    assert "value: /data/runs/master" in k8s_master
