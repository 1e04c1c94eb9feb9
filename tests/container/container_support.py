"""Helpers of the real container tier: the docker CLI, compose projects, the image build, files
on a volume, and a relay that lets containers reach a loopback-only server on this host.

Environment (written by `.ci/container-engine up`; all optional on a developer machine):

``DOCKER_HOST``                         the engine (default: the local socket)
``CONTAINER_TEST_BASE_IMAGE``           build arg BASE_IMAGE (a local image: no registry needed)
``CONTAINER_TEST_TORCH_INDEX_URL``      build arg TORCH_INDEX_URL (a local PEP 503 index)
``CONTAINER_TEST_TORCH_VERSION``        build arg TORCH_VERSION
``CONTAINER_TEST_BUILD_NETWORK``        ``host`` so a build reaches that index on 127.0.0.1
``CONTAINER_TEST_UNAVAILABLE``          why provisioning failed (the tier skips naming it)
``CONTAINER_TEST_REPORT``               a JSON file that receives the build measurements
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LABEL = "speedtronic.test"  # on every container, volume and network the tier creates


def docker(
    *args: str,
    check: bool = True,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run the docker CLI; on failure (with ``check``) raise with its stderr."""
    result = subprocess.run(
        ["docker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the tier cannot run here, or None when an engine and compose answer."""
    reason = os.environ.get("CONTAINER_TEST_UNAVAILABLE")
    if reason:
        return f"container engine provisioning failed: {reason}"
    if shutil.which("docker") is None:
        return "no docker CLI on PATH (.ci/container-engine installs Debian's docker.io)"
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        info = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=30)
    except subprocess.TimeoutExpired:
        return f"the Docker engine at {where} did not answer within 30 s"
    if info.returncode != 0:
        line = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        return f"no Docker engine reachable at {where}: {line}"
    compose = docker("compose", "version", check=False, timeout=30)
    if compose.returncode != 0:
        return "no Compose v2 plugin (`docker compose`; .ci/container-engine installs one)"
    return None


def build_args() -> dict[str, str]:
    """BASE_IMAGE / TORCH_INDEX_URL / TORCH_VERSION for the build: the provisioned local ones,
    else the Dockerfile's documented CPU variant."""
    args = {"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    for name in ("BASE_IMAGE", "TORCH_INDEX_URL", "TORCH_VERSION"):
        value = os.environ.get(f"CONTAINER_TEST_{name}")
        if value:
            args[name] = value
    return args


def build_network() -> str | None:
    """``host`` when the build must reach a wheel index on this machine's loopback."""
    return os.environ.get("CONTAINER_TEST_BUILD_NETWORK") or None


def build_argv(tag: str) -> list[str]:
    """`docker build` arguments for an image ``tag`` of this suite (before the context)."""
    argv = ["build", "--tag", tag, "--label", LABEL]
    if build_network():
        argv += ["--network", build_network()]
    for key, value in build_args().items():
        argv += ["--build-arg", f"{key}={value}"]
    return argv


def build_image(tag: str) -> dict[str, Any]:
    """`docker build` the repository with the classic builder; measurements as a dict."""
    argv = build_argv(tag)
    started = time.monotonic()
    docker(*argv, str(REPO), timeout=1800, env={"DOCKER_BUILDKIT": "0"})
    seconds = time.monotonic() - started
    size = int(docker("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip())
    layers = json.loads(
        docker("image", "inspect", tag, "--format", "{{json .RootFS.Layers}}").stdout
    )
    return {
        "tag": tag,
        "build_seconds": round(seconds, 1),
        "size_bytes": size,
        "layers": len(layers),
    }


def report(key: str, value: Any) -> None:
    """Add a measurement to the JSON file named by CONTAINER_TEST_REPORT (if any)."""
    path = os.environ.get("CONTAINER_TEST_REPORT")
    if not path:
        return
    target = Path(path)
    data = json.loads(target.read_text()) if target.exists() else {}
    data[key] = value
    target.write_text(json.dumps(data, indent=2) + "\n")


def read_volume(image: str, volume: str, code: str, timeout: float = 120) -> Any:
    """Run Python ``code`` in a throwaway container with ``volume`` read-only at /data; the
    code prints one JSON document, which is returned."""
    result = docker(
        "run", "--rm", "--label", LABEL, "--network", "none", "--read-only",
        "--volume", f"{volume}:/data:ro", "--entrypoint", "python3", image, "-c", code,
        timeout=timeout,
    )  # fmt: skip
    return json.loads(result.stdout)


def jsonl_events(image: str, volume: str, path: str, event: str) -> list[dict[str, Any]]:
    """The ``event`` lines of the JSONL file ``path`` on ``volume`` ([] when missing)."""
    code = (
        "import json, pathlib\n"
        f"p = pathlib.Path({path!r})\n"
        "lines = p.read_text().splitlines() if p.exists() else []\n"
        "out = [json.loads(line) for line in lines if line.strip()]\n"
        f"print(json.dumps([e for e in out if e.get('event') == {event!r}]))\n"
    )
    return read_volume(image, volume, code)


def checkpoint_steps(image: str, volume: str, runs: str = "/data/runs") -> dict[str, int]:
    """``{node directory: step of its latest.json}`` under ``runs`` on ``volume``."""
    code = (
        "import json, pathlib\n"
        f"root = pathlib.Path({runs!r})\n"
        "out = {}\n"
        "for pointer in sorted(root.glob('*/**/latest.json')):\n"
        "    node = pointer.relative_to(root).parts[0]\n"
        "    try:\n"
        "        out[node] = max(out.get(node, -1), int(json.loads(pointer.read_text())['step']))\n"
        "    except (OSError, ValueError, KeyError):\n"
        "        pass\n"
        "print(json.dumps(out))\n"
    )
    return read_volume(image, volume, code)


@dataclass
class Compose:
    """One compose project over the repository's compose files (plus a test override)."""

    files: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    override: Path | None = None
    name: str = field(default_factory=lambda: f"sttest{uuid.uuid4().hex[:8]}")

    def __call__(self, *args: str, check: bool = True, timeout: float = 600):
        argv = ["compose", "--project-name", self.name, "--project-directory", str(REPO)]
        for name in self.files:
            argv += ["--file", str(REPO / name)]
        if self.override is not None:
            argv += ["--file", str(self.override)]
        return docker(*argv, *args, check=check, timeout=timeout, env=self.env)

    @property
    def volume(self) -> str:
        """The project's shared data volume."""
        return f"{self.name}_speedtronic-data"

    def containers(self, service: str) -> list[dict[str, Any]]:
        """``docker inspect`` of the service's containers (running or exited), by number."""
        ids = self("ps", "--all", "--quiet", service).stdout.split()
        if not ids:
            return []
        found = json.loads(docker("inspect", *ids).stdout)
        return sorted(
            found, key=lambda c: int(c["Config"]["Labels"]["com.docker.compose.container-number"])
        )

    def wait_exited(self, services: list[str], timeout: float) -> list[dict[str, Any]]:
        """Wait until every container of ``services`` has exited; their inspect records."""
        deadline = time.monotonic() + timeout
        while True:
            found = [c for s in services for c in self.containers(s)]
            if found and all(c["State"]["Status"] == "exited" for c in found):
                return found
            if time.monotonic() > deadline:
                states = {c["Name"]: c["State"]["Status"] for c in found}
                raise AssertionError(f"timed out after {timeout}s: {states}\n{self.logs()[-6000:]}")
            time.sleep(2)

    def logs(self, *services: str) -> str:
        """Every line the project's containers printed so far."""
        return self("logs", "--no-color", "--timestamps", *services, check=False).stdout

    def down(self) -> None:
        """Remove containers, networks and volumes of the project."""
        self("down", "--volumes", "--remove-orphans", "--timeout", "120", check=False, timeout=300)


def write_build_override(path: Path, services: list[str]) -> Path:
    """The one test-only compose file: build args and build network for ``services``."""
    build: dict[str, Any] = {"args": build_args()}
    if build_network():
        build["network"] = build_network()
    path.write_text(json.dumps({"services": {s: {"build": build} for s in services}}, indent=2))
    return path


def docker_bridge_address() -> str:
    """The host's address on Docker's default bridge (reachable from every container)."""
    raw = json.loads(docker("network", "inspect", "bridge").stdout)[0]
    for config in raw["IPAM"].get("Config") or []:
        if config.get("Gateway"):
            return str(config["Gateway"])
    name = raw.get("Options", {}).get("com.docker.network.bridge.name", "docker0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        packed = struct.pack("256s", name.encode()[:15])
        address = fcntl.ioctl(probe.fileno(), 0x8915, packed)[20:24]  # SIOCGIFADDR
    return str(ipaddress.IPv4Address(address))


class Relay:
    """Forward TCP connections from ``listen_host`` (an address containers reach) to a server
    on this host's loopback, for the length of a test."""

    def __init__(self, listen_host: str, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._server = socket.create_server((listen_host, 0))
        self.address = self._server.getsockname()[:2]
        self._closing = threading.Event()
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=30)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closing.set()
        self._server.close()


@contextlib.contextmanager
def relay(listen_host: str, target_port: int) -> Iterator[Relay]:
    """A `Relay` for the block."""
    forward = Relay(listen_host, target_port)
    try:
        yield forward
    finally:
        forward.close()
