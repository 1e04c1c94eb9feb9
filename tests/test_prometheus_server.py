"""A real Prometheus server scrapes a running `speedtronic run` and stores its series.

Uses the `prometheus` binary (Debian package `prometheus`, installed by .ci/install-tools);
skips, saying so, only where it is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse

import pytest
import yaml
from test_entrypoint import start, tiny_config
from test_rehearsal_support import free_port, http_get, scrape_value, wait_until

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is not installed (apt-get install prometheus; "
        ".ci/install-tools does this)",
    ),
]


def query(port: int, expression: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expression)}"
    status, body = http_get(url)
    if status != 200:
        return []
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_prometheus_scrapes_speedtronic_train_steps_total(tmp_path):
    target_port = free_port()
    trainer = start(tmp_path, "scraped", tiny_config(tmp_path), target_port)
    prom_port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "speedtronic",
                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"),
    )
    try:
        wait_until(
            lambda: (scrape_value(target_port, "speedtronic_train_steps_total") or 0) >= 1,
            180,
            "training to start",
            [trainer],
        )

        def scraped():
            result = query(prom_port, "speedtronic_train_steps_total")
            return result if result and float(result[0]["value"][1]) >= 1 else None

        result = wait_until(scraped, 120, "Prometheus to scrape speedtronic_train_steps_total")
        labels = result[0]["metric"]
        assert labels["job"] == "speedtronic" and labels["role"] == "single"
        assert labels["node_id"]
        assert float(query(prom_port, 'up{job="speedtronic"}')[0]["value"][1]) == 1
        assert query(prom_port, "speedtronic_train_step_seconds_count")
        assert trainer.terminate(timeout=120) == 0, trainer.output()[-3000:]
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prometheus.kill()
        trainer.kill()
