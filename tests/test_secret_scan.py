"""Secret scan (issue 12, deliverable 4): full master + worker runs, then a search for the
token in every encoding through everything they left behind.

A recognisable token is given the ways users give it, to each master and worker pair (a
shared-directory run of ``speedtronic train`` and a Hub-emulator run of ``speedtronic run``):
``HF_TOKEN`` ending in ``\\r\\n`` (a Kubernetes ``secretKeyRef`` of a file with a Windows line
end) to the master, an ``hf_token`` secret file with a trailing newline to the worker. The
emulator requires the token, so rounds only happen when the whitespace was stripped.
``--set distributed.token=...`` is refused (exit 2), and a master the Hub refuses exits 2.
The token given to a choice field, or as the TensorBoard tracker's run name, is refused
(issue 31); the shared-directory worker runs with the TensorBoard tracker.
Then every file under the output and exchange directories (names and bytes, checkpoints and
safetensors included), the name of every file and directory the runs left (hub caches and
working directory too), the emulator's repository files, stdout/stderr, JSONL, ``/metrics``,
``/healthz``, ``/readyz``, ``config show``/``validate`` output and the error texts of refused
and failing runs are scanned for the token, in any letter case: raw, repr- and JSON-escaped,
percent-encoded, UTF-16 and base64 (at every alignment). The token is deliberately not shaped
like a real Hub token, so the pattern-based scrubbing cannot hide a missing redaction.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from process_support import STARTED, child_env, free_port

from speedtronic.testing.hub_server import FaultConfig, HubEmulator

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_scan+Secret-8472_xyzzy+QWERTYuiop"  # '+' percent-encodes; '_'/'-' defeat patterns


def _needles(token: str) -> dict[str, bytes]:
    """Every encoding of ``token`` the scan looks for."""
    raw = token.encode()
    needles = {
        "raw": raw,
        "repr": repr(token)[1:-1].encode(),
        "json": json.dumps(token)[1:-1].encode(),
        "percent": quote(token, safe="").encode(),
        "percent-plus": quote_plus(token).encode(),
        "utf-16": token.encode("utf-16-le"),
    }
    for shift in range(3):  # base64 of the token at any offset of a longer payload:
        for name, encode in (("b64", base64.b64encode), ("b64url", base64.urlsafe_b64encode)):
            encoded = encode(b"\0" * shift + raw)  # the first group mixes in the prefix,
            needles[f"{name}+{shift}"] = encoded[4 if shift else 0 : -4]  # the last may pad
    return needles


NEEDLES = _needles(TOKEN)


def _hits(data: bytes) -> list[str]:
    """The encodings of the token found in ``data``, in any letter case (a choice field
    lowercases what it is given; issue 31)."""
    lowered = data.lower()
    return [name for name, needle in NEEDLES.items() if needle and needle.lower() in lowered]


class Scan:
    """Collects every text and file the runs produced and what was found in them."""

    def __init__(self) -> None:
        self.items = 0
        self.bytes = 0
        self.kinds: dict[str, int] = {}
        self.found: list[str] = []

    def text(self, kind: str, where: str, data: bytes | str) -> None:
        blob = data.encode() if isinstance(data, str) else data
        self.items += 1
        self.bytes += len(blob)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.found += [f"{where}: {hit}" for hit in _hits(blob)]

    def tree(self, kind: str, root: Path) -> None:
        for path in sorted(root.rglob("*")):
            self.text("path name", str(path), str(path.relative_to(root)))
            if path.is_file() and not path.is_symlink():
                self.text(kind, str(path), path.read_bytes())

    def names(self, root: Path) -> None:
        """The name of every file and directory under ``root`` (issue 31: a tracker made a
        directory named after the token), the contents not read."""
        for path in sorted(root.rglob("*")):
            self.text("file or directory name", str(path), str(path.relative_to(root)))


def _base_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = child_env(
        HF_HUB_DISABLE_TELEMETRY="1",
        SPEEDTRONIC_SECRETS_DIR=str(tmp / "no-secrets"),
        SPEEDTRONIC_RUN__MAX_STEPS="20",
        SPEEDTRONIC_RUN__DEVICE="cpu",
        SPEEDTRONIC_DISTRIBUTED__INNER_STEPS="5",
        SPEEDTRONIC_DISTRIBUTED__MIN_NODES="2",
        SPEEDTRONIC_DISTRIBUTED__POLL_INTERVAL="0.2",
        SPEEDTRONIC_DISTRIBUTED__ROUND_TIMEOUT="20",
        SPEEDTRONIC_DISTRIBUTED__RETRY_INITIAL="0.05",
        SPEEDTRONIC_DISTRIBUTED__RETRY_MAX="0.5",
        SPEEDTRONIC_DISTRIBUTED__REQUEST_TIMEOUT="10",
        SPEEDTRONIC_CHECKPOINT__EVERY_STEPS="5",
        SPEEDTRONIC_EVAL__TOKENS="256",
        SPEEDTRONIC_EVAL__EVERY_STEPS="10",
        SPEEDTRONIC_LOGGING__EVERY_STEPS="1",
    )
    env.update(extra)
    return env


class Node:
    """One ``speedtronic train|run`` process with its own output directory."""

    def __init__(self, tmp: Path, name: str, role: str, command: str, env: dict[str, str]):
        self.tmp, self.name, self.command = tmp, name, command
        self.dir = tmp / "out" / name
        self.port = free_port()
        self.log = tmp / "logs" / f"{name}.out"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.env = dict(
            env,
            SPEEDTRONIC_DISTRIBUTED__ROLE=role,
            SPEEDTRONIC_NODE_ID=name,
            SPEEDTRONIC_RUN__OUTPUT_DIR=str(self.dir),
            SPEEDTRONIC_LOGGING__JSON_FILE=str(self.dir / "events.jsonl"),
            SPEEDTRONIC_DISTRIBUTED__CACHE_DIR=str(tmp / "out" / "hubcache" / name),
            SPEEDTRONIC_METRICS__HOST="127.0.0.1",
            SPEEDTRONIC_METRICS__PORT=str(self.port),
        )
        self.proc: subprocess.Popen | None = None
        self.pages: list[tuple[str, str]] = []

    def start(self) -> Node:
        args = [sys.executable, "-m", "speedtronic", self.command]
        args += ["--config", str(ROOT / "configs" / "diloco.yaml")]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, cwd=self.tmp, env=self.env, stdout=out, stderr=out)
        STARTED.append(self.proc)
        return self

    def scrape(self) -> None:
        for page in ("metrics", "healthz", "readyz"):
            url = f"http://127.0.0.1:{self.port}/{page}"
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    self.pages.append((page, answer.read().decode()))
            except OSError as exc:  # 503 while not ready / not started yet
                body = getattr(exc, "read", None)
                if callable(body):
                    self.pages.append((page, body().decode(errors="replace")))

    def events(self, name: str) -> list[dict]:
        path = self.dir / "events.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            if row.get("event") == name:
                rows.append(row)
        return rows


def _run_pair(nodes: list[Node], *, timeout: float = 300.0) -> None:
    for node in nodes:
        node.start()
    deadline = time.monotonic() + timeout
    while any(node.proc.poll() is None for node in nodes):
        assert time.monotonic() < deadline, [node.log.read_text()[-2000:] for node in nodes]
        for node in nodes:
            if node.command == "run" and node.proc.poll() is None:
                node.scrape()
        time.sleep(0.5)
    for node in nodes:
        assert node.proc.returncode == 0, node.log.read_text()[-3000:]


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _cli(tmp: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "speedtronic", *argv]
    return subprocess.run(command, cwd=tmp, env=env, capture_output=True, timeout=120)


def test_no_encoding_of_the_token_survives_a_full_run(tmp_path) -> None:
    scan = Scan()
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "hf_token").write_text(TOKEN + "\n")  # a Docker/Kubernetes secret file
    from_env = {"HF_TOKEN": TOKEN + "\r\n"}  # a secretKeyRef of a file with a Windows line end
    from_file = {"SPEEDTRONIC_SECRETS_DIR": str(secrets)}

    # 1. shared directory, `speedtronic train`: master with HF_TOKEN, worker with the file
    # (and a TensorBoard tracker, which names a directory after the run: issue 31)
    directory_env = _base_env(
        tmp_path, SPEEDTRONIC_DISTRIBUTED__REPO_ID=f"file://{tmp_path / 'exchange'}"
    )
    tracked = {"SPEEDTRONIC_LOGGING__TRACKERS": "[tensorboard]"} if _has("tensorboard") else {}
    pair = [
        Node(tmp_path, "dir-master", "master", "train", {**directory_env, **from_env}),
        Node(tmp_path, "dir-worker", "worker", "train", {**directory_env, **from_file, **tracked}),
    ]
    _run_pair(pair)
    assert pair[0].events("outer_step"), pair[0].log.read_text()[-2000:]

    # 2. Hub emulator (it requires the token: rounds happen only if the whitespace was
    # stripped), `speedtronic run` with /metrics: master with HF_TOKEN, worker with the file
    emulator = HubEmulator(0, token=TOKEN, faults=FaultConfig(seed=7)).start()
    try:
        hub_env = _base_env(
            tmp_path, HF_ENDPOINT=emulator.url, SPEEDTRONIC_DISTRIBUTED__REPO_ID="org/scan"
        )
        hub = [
            Node(tmp_path, "hub-master", "master", "run", {**hub_env, **from_env}),
            Node(
                tmp_path,
                "hub-worker",
                "worker",
                "run",
                {**hub_env, **from_file, "SPEEDTRONIC_LOGGING__FORMAT": "json"},
            ),
        ]
        _run_pair(hub)
        assert hub[0].events("outer_step"), hub[0].log.read_text()[-2000:]
        assert any(page == "metrics" for node in hub for page, _ in node.pages)
        for name, data in emulator.files("org/scan").items():
            scan.text("hub repository file", f"hub:{name}", name.encode() + b"\n" + data)

        # 3. a master the Hub refuses (it expects another token): its error texts
        other = HubEmulator(0, token="hf_the_right_one_0000", faults=FaultConfig()).start()
        try:
            refused_env = _base_env(
                tmp_path,
                HF_TOKEN=TOKEN + "\n",
                HF_ENDPOINT=other.url,
                SPEEDTRONIC_DISTRIBUTED__REPO_ID="org/other",
            )
            refused = Node(tmp_path, "hub-refused", "master", "run", refused_env).start()
            assert refused.proc.wait(180) == 2, refused.log.read_text()[-2000:]
        finally:
            other.stop()
    finally:
        emulator.stop()

    # 4. the token through --set is refused, and config show/validate with both sources
    outputs: list[tuple[str, subprocess.CompletedProcess]] = []
    config = str(ROOT / "configs" / "diloco.yaml")
    refused_set = _cli(
        tmp_path,
        directory_env,
        "validate",
        "--config",
        config,
        "--set",
        f"distributed.token={TOKEN}",
    )
    assert refused_set.returncode == 2 and b"HF_TOKEN" in refused_set.stderr
    outputs.append(("--set refused", refused_set))
    train_set = _cli(
        tmp_path, directory_env, "train", "--config", config, "--set", f"distributed.token={TOKEN}"
    )
    assert train_set.returncode == 2
    outputs.append(("train --set refused", train_set))
    for env_name, env in (
        ("env", {**hub_env, **from_env}),
        ("secret file", {**hub_env, **from_file}),
    ):
        for argv in (
            ("validate", "--config", config),
            ("validate", "--config", config, "--format", "json"),
            ("config", "show", "--config", config, "--sources"),
            ("config", "show", "--config", config, "--sources", "--format", "json"),
        ):
            done = _cli(tmp_path, env, *argv)
            assert done.returncode == 0, done.stderr
            if argv[0] == "config":  # validate prints a verdict, not the config (issue 29)
                assert b"<redacted>" in done.stdout
            outputs.append((f"{' '.join(argv[:2])} ({env_name})", done))
    wrong_field = {**directory_env, **from_env, "SPEEDTRONIC_RUN__SEED": TOKEN}
    bad = _cli(tmp_path, wrong_field, "validate", "--config", config)
    assert bad.returncode == 2 and b"run.seed" in bad.stderr
    outputs.append(("token in a wrong field", bad))
    # 5. the token in a choice field (lowercased before the check) and as the tracker's run
    # name (a directory): refused, in no case shown, no directory made (issue 31)
    file_env = {**directory_env, **from_file}
    for dotted in ("distributed.sync", "optimizer.name", "logging.trackers"):
        choice = _cli(
            tmp_path, file_env, "validate", "--config", config, "--set", f"{dotted}={TOKEN}"
        )
        assert choice.returncode == 2 and dotted.encode() in choice.stderr
        outputs.append((f"token in {dotted}", choice))
    named = _cli(
        tmp_path,
        file_env,
        "train",
        "--config",
        config,
        "--output-dir",
        str(tmp_path / "out" / "named"),
        "--set",
        "logging.trackers=[tensorboard]",
        "--set",
        f"logging.run_name={TOKEN.lower()}",
    )
    assert named.returncode == 2 and b"logging.run_name" in named.stderr
    outputs.append(("token as the tracker's run name", named))

    # the scan
    for label, done in outputs:
        scan.text("cli output", f"{label} stdout", done.stdout)
        scan.text("cli output", f"{label} stderr", done.stderr)
    for node in [*pair, *hub, refused]:
        scan.text("process output", str(node.log), node.log.read_bytes())
        for page, body in node.pages:
            scan.text(f"/{page}", f"{node.name} /{page}", body)
    scan.tree("file", tmp_path / "out")
    scan.tree("exchange file", tmp_path / "exchange")
    scan.names(tmp_path)  # everything the runs left, the hub caches and the working dir too
    if tracked:
        assert list((tmp_path / "out" / "dir-worker" / "tensorboard").iterdir())
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(scan.kinds.items()))
    print(
        f"\nsecret scan: {scan.items} items, {scan.bytes} bytes ({kinds}); hits: {len(scan.found)}"
    )
    assert scan.kinds.get("file", 0) > 20 and scan.kinds.get("/metrics", 0) > 0
    assert not scan.found, scan.found[:20]
