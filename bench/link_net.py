"""The network of ``bench/diloco_link.py``: a slow link made of real parts.

Each node gets a network namespace of its own, joined to the Hub's namespace by a veth pair;
``tc qdisc ... tbf`` shapes both ends of every pair (the upload rate on the node's end, the
download rate on the Hub's end)::

    node i namespace                                       hub namespace
    speedtronic train                                      Hub emulator on 127.0.0.1:P (API)
      -> 127.0.0.1:P, :S  (forwarder)                        and 127.0.0.1:S (LFS storage)
      -> veth "wan0" 10.77.i.2 ==== tbf ==== veth "h<i>" 10.77.i.1:P, :S (relay + latency)
                             up: tbf on "wan0" egress     down: tbf on "h<i>" egress

The emulator answers on loopback only, and a large file is a redirect to ``localhost:S``, so a
node reaches it through a forwarder on its own loopback, and the Hub's side through a relay on
each veth address. That relay adds the latency: every chunk it reads waits the given one-way
time before it is written on (both directions), in a queue of up to ``link_relay.QUEUE_BYTES``,
so the delay never limits throughput. What it does not emulate: TCP's own control loop over the
shaped hop sees the veth's round trip, not the added one (no window/RTT limit on a long fat
link); every HTTP request and answer does pay the added time, once each way. The relay
connects to the emulator from 127.0.0.<10+i>, so the emulator's request log names the node.

The processes that run inside the namespaces (the emulator with its request log, the relays)
are ``bench/link_relay.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

#: The subnet of node i's veth pair: 10.77.i.1 (the Hub's end) and 10.77.i.2 (the node's).
SUBNET = "10.77"
#: The emulator's API port inside the hub namespace (its storage port is picked at start).
HUB_PORT = 8765
#: The node's end of its veth pair (the Hub's end of node i's pair is ``h<i>``).
NODE_END = "wan0"
#: tbf's queue bound (its ``latency``): packets waiting longer are dropped (TCP backs off).
TBF_QUEUE_MS = 100
#: A node's loopback hop to its forwarder is not part of any real link: with the buffers Linux
#: grows on loopback (no loss there, so a window that grows unchecked), a node handed it
#: megabytes of an upload at once, which then queued before the shaped link where nothing could
#: take them back; a real node's socket sits on the link, its buffer sized by the link's
#: window. So the forwarder takes at most FORWARDER_RCVBUF bytes ahead (SO_RCVBUF) and every
#: socket of a node's namespace holds at most NOTSENT_LOWAT bytes not sent yet
#: (``net.ipv4.tcp_notsent_lowat``; the forwarder's own socket on the link keeps its window).
FORWARDER_RCVBUF = 128 * 1024
NOTSENT_LOWAT = 128 * 1024
#: Prefix of every namespace a run creates: ``<prefix><pid>x<hex>-hub`` / ``-n<i>``.
PREFIX = "stlb"


def source_ip(node: int) -> str:
    """The loopback address the Hub-side relay connects from for node ``node``."""
    return f"127.0.0.{10 + node}"


def node_of_source(address: str) -> int | None:
    """Node index of an emulator client address (None: not one of the relays')."""
    parts = address.split(".")
    if len(parts) == 4 and parts[:3] == ["127", "0", "0"] and int(parts[3]) >= 10:
        return int(parts[3]) - 10
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


def support_problem() -> str | None:
    """Why this machine cannot build the link (None: it can): root, ``ip``, ``tc`` and
    ``sysctl`` on PATH, and a namespace with a veth pair, a tbf qdisc and its own
    ``tcp_notsent_lowat`` actually created."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (iproute2, procps)"
    name = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}-probe"
    try:
        _run("ip", "netns", "add", name)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"`ip netns add` failed: {_why(exc)}"
    try:
        _run("ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        _run("tc", "-n", name, "qdisc", "add", "dev", "probe0", "root", *tbf_args(1e6))
        lowat = f"net.ipv4.tcp_notsent_lowat={NOTSENT_LOWAT}"
        _run("ip", "netns", "exec", name, "sysctl", "-qw", lowat)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"veth, tbf or a namespace's tcp_notsent_lowat unavailable: {_why(exc)}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return (exc.stderr or str(exc)).strip().splitlines()[-1]
    return str(exc)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (``/proc``; None once it
    is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tbf_args(rate_bps: float) -> list[str]:
    """tbf for ``rate_bps`` bits/s: a bucket of 10 ms at that rate (at least 64 KiB, so a
    GSO super-packet fits), queue bound ``TBF_QUEUE_MS``."""
    burst = max(64 << 10, int(rate_bps / 8 * 0.01))
    return [
        "tbf",
        "rate",
        f"{int(rate_bps)}bit",
        "burst",
        str(burst),
        "latency",
        f"{TBF_QUEUE_MS}ms",
    ]


@dataclasses.dataclass
class Helper:
    """A process started inside a namespace, with the file its output goes to."""

    name: str
    proc: subprocess.Popen[bytes]
    out: IO[bytes]

    def first_line(self, timeout: float = 60.0) -> dict:
        """The first JSON line the helper prints (its ports, or that it is ready)."""
        path = Path(self.out.name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = path.read_text()
            if text.strip():
                return dict(json.loads(text.splitlines()[0]))
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start: {path.read_text()[-2000:]}")


class LinkLab:
    """The namespaces and veth pairs of one bench run (names unique to this process), the
    processes started in them, and their removal on every exit path (:meth:`close`)."""

    def __init__(self, nodes: int) -> None:
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.hub = f"{self.tag}-hub"
        self.nodes = [f"{self.tag}-n{i}" for i in range(nodes)]
        self.helpers: list[Helper] = []
        self._made: list[str] = []
        self._lock = threading.Lock()

    def __enter__(self) -> LinkLab:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """The hub namespace, one per node, a veth pair each (addresses up, no shaping)."""
        for name in (self.hub, *self.nodes):
            _run("ip", "netns", "add", name)
            self._made.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        for i, name in enumerate(self.nodes):
            hub_end = f"h{i}"
            _run(
                "ip",
                "-n",
                self.hub,
                "link",
                "add",
                hub_end,
                "type",
                "veth",
                "peer",
                "name",
                NODE_END,
                "netns",
                name,
            )
            _run("ip", "-n", self.hub, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", hub_end)
            _run("ip", "-n", self.hub, "link", "set", hub_end, "up")
            _run("ip", "-n", name, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", NODE_END)
            _run("ip", "-n", name, "link", "set", NODE_END, "up")
            lowat = f"net.ipv4.tcp_notsent_lowat={NOTSENT_LOWAT}"  # see NOTSENT_LOWAT
            _run("ip", "netns", "exec", name, "sysctl", "-qw", lowat)

    def shape(self, up_bps: float | None, down_bps: float | None) -> None:
        """tbf at ``up_bps`` on every node's end and ``down_bps`` on the Hub's ends (None:
        that direction unshaped)."""
        for i, name in enumerate(self.nodes):
            for ns, dev, rate in ((name, NODE_END, up_bps), (self.hub, f"h{i}", down_bps)):
                _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
                if rate is not None:
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf_args(rate))

    def open_hub(self, folder: Path, token: str, delay_ms: float) -> tuple[int, list[Helper]]:
        """Start the Hub emulator (request log ``folder/requests.jsonl``), the relay on the
        Hub's veth ends (``delay_ms`` each way; it samples the counters into
        ``folder/counters.jsonl``) and each node's forwarder; returns the API port (the same
        on every node's loopback) and the helpers, emulator last."""
        py, me = sys.executable, str(Path(__file__).resolve().parent / "link_relay.py")
        hub_argv = [py, me, "hub", "--port", str(HUB_PORT), "--token", token]
        hub = self.start(
            self.hub,
            "hub",
            [*hub_argv, "--log", str(folder / "requests.jsonl")],
            folder / "hub.out",
        )
        ports = hub.first_line()
        pair = (int(ports["port"]), int(ports["storage_port"]))
        routes = []
        for i in range(len(self.nodes)):
            for port in pair:
                routes += ["--route", f"{SUBNET}.{i}.1:{port}=127.0.0.1:{port}@{source_ip(i)}"]
        sample = ["--sample", *[f"h{i}" for i in range(len(self.nodes))]]
        relay_argv = [py, me, "relay", "--delay-ms", str(delay_ms), *routes, *sample]
        helpers = [
            self.start(
                self.hub,
                "hub-relay",
                [*relay_argv, "--log", str(folder / "counters.jsonl")],
                folder / "hub-relay.out",
            )
        ]
        for i, ns in enumerate(self.nodes):
            mine = [x for p in pair for x in ("--route", f"127.0.0.1:{p}={SUBNET}.{i}.1:{p}")]
            mine += ["--rcvbuf", str(FORWARDER_RCVBUF)]
            helpers.append(
                self.start(ns, f"relay-{i}", [py, me, "relay", *mine], folder / f"relay-{i}.out")
            )
        for helper in helpers:
            helper.first_line()
        return pair[0], [*helpers, hub]

    def counters(self) -> dict[int, tuple[int, int]]:
        """``{node: (bytes the Hub's end received, bytes it sent)}``: node i's upload and
        download on the wire (Ethernet frames: headers and TCP included)."""
        rows = json.loads(_run("ip", "-n", self.hub, "-j", "-s", "link", "show").stdout)
        found: dict[int, tuple[int, int]] = {}
        for row in rows:
            name = row.get("ifname", "")
            if name.startswith("h") and name[1:].isdigit():
                stats = row["stats64"]
                found[int(name[1:])] = (int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))
        return found

    def start(
        self,
        ns: str,
        name: str,
        argv: list[str],
        out: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Helper:
        """Start ``argv`` in namespace ``ns`` (``ip netns exec`` execs it: the pid is the
        program's), output to ``out``; :meth:`close` ends it if it is still running."""
        handle = open(out, "wb")  # noqa: SIM115 - closed by stop()
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
        )
        helper = Helper(name, proc, handle)
        with self._lock:
            self.helpers.append(helper)
        return helper

    def stop(self, helper: Helper, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; the exit code."""
        proc = helper.proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        helper.out.close()
        with self._lock:
            if helper in self.helpers:
                self.helpers.remove(helper)
        return proc.returncode

    def close(self) -> None:
        """End every process started here (newest first), then delete the namespaces (their
        veth pairs and qdiscs go with them). Safe to call twice."""
        while self.helpers:
            self.stop(self.helpers[-1], grace=3.0)
        while self._made:
            _run("ip", "netns", "del", self._made.pop(), check=False)

    def stale(self) -> list[str]:
        """Namespaces of earlier runs of this bench whose process is gone (a SIGKILL leaves
        them): named here so that the user can delete them."""
        listed = _run("ip", "netns", "list", check=False).stdout.split()
        gone = []
        for name in listed:
            if not name.startswith(PREFIX) or name.startswith(self.tag):
                continue
            pid = name[len(PREFIX) :].split("x", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                gone.append(name)
        return gone
