"""The processes ``bench/diloco_link.py`` runs inside its network namespaces (started by
``link_net.LinkLab.open_hub``):

- ``hub``: the project's Hub emulator (``speedtronic.testing.hub_server``) on 127.0.0.1, with a
  request log: one JSON line per request (time, client address, method, path, status, body
  bytes in and out, and for a commit the files it adds or deletes). Its first output line
  names its ports.
- ``relay``: TCP forwarding by routes ``LISTEN=TARGET[@SOURCE]``; with ``--delay-ms`` every
  chunk read waits that long before it is written on, in both directions, in a queue of up
  to ``QUEUE_BYTES`` (the delay does not limit throughput); with ``--sample`` it writes the
  interfaces' byte counters every 0.1 s when they change. Its first output line says it is
  ready. With ``--rcvbuf`` its accepted connections take at most that many bytes ahead (a
  node's forwarder: see ``link_net.FORWARDER_RCVBUF``).

    python bench/link_relay.py hub --port 8765 --token T --log requests.jsonl
    python bench/link_relay.py relay --route 10.77.0.1:8765=127.0.0.1:8765@127.0.0.10 \
        --delay-ms 20 --sample h0 --log counters.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from link_net import HUB_PORT

#: Bytes a relay direction holds while they wait out the added latency.
QUEUE_BYTES = 64 << 20


def serve_hub(port: int, token: str, log: Path) -> int:
    """The project's Hub emulator on 127.0.0.1:``port`` with a request log: one JSON line per
    request (time, client, method, path, bytes in and out). Prints its ports as one JSON line;
    runs until SIGTERM."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speedtronic.testing import hub_server
    from speedtronic.testing.hub_routes import HubHandler

    sink = open(log, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the process
    lock = threading.Lock()

    class LoggedHandler(HubHandler):
        """The emulator's handler, noting what each request moved."""

        def _body(self) -> bytes:
            body = super()._body()
            self.got = len(body)
            if "/commit/" in self.path:
                self.files = _commit_files(body)
            return body

        def send_header(self, keyword: str, value: str) -> None:
            if keyword.lower() == "content-length":
                self.sent = int(value)
            super().send_header(keyword, value)

        def send_response(self, code: int, message: str | None = None) -> None:
            self.status = code
            super().send_response(code, message)

        def _logged(self, method: str) -> None:
            self.got, self.sent, self.status = 0, 0, 0
            self.files: list[dict[str, object]] = []
            started = time.time()
            try:
                getattr(super(), f"do_{method}")()
            finally:
                row = {
                    "t0": started,
                    "t1": time.time(),
                    "client": self.client_address[0],
                    "storage": bool(self.server.storage),  # type: ignore[attr-defined]
                    "method": method,
                    "path": self.path.split("?", 1)[0],
                    "status": self.status,
                    "in": self.got,
                    "out": 0 if method == "HEAD" else self.sent,
                }
                if self.files:
                    row["commit"] = self.files
                with lock:
                    sink.write(json.dumps(row) + "\n")

        def do_GET(self) -> None:
            self._logged("GET")

        def do_HEAD(self) -> None:
            self._logged("HEAD")

        def do_POST(self) -> None:
            self._logged("POST")

        def do_PUT(self) -> None:
            self._logged("PUT")

    hub_server.HubHandler = LoggedHandler  # type: ignore[misc]  # start() serves with it
    emulator = hub_server.HubEmulator(port, token=token).start()
    storage = int(emulator.storage_url.rsplit(":", 1)[1])
    print(json.dumps({"port": emulator.port, "storage_port": storage}), flush=True)
    _wait_for_term()
    emulator.stop()
    sink.close()
    return 0


def _commit_files(body: bytes) -> list[dict[str, object]]:
    """What a commit's NDJSON adds or deletes: path, kind (``file``: inline base64, ``lfs``:
    a pointer to an uploaded object, ``deleted``), size and object id."""
    files: list[dict[str, object]] = []
    for line in body.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        key, value = item.get("key"), item.get("value") or {}
        if key == "file":
            size = len(value.get("content", "")) * 3 // 4
            files.append({"path": value.get("path"), "kind": "file", "size": size})
        elif key == "lfsFile":
            files.append(
                {
                    "path": value.get("path"),
                    "kind": "lfs",
                    "size": value.get("size"),
                    "oid": value.get("oid"),
                }
            )
        elif key in ("deletedFile", "deletedFolder"):
            files.append({"path": value.get("path"), "kind": "deleted"})
    return files


def _wait_for_term() -> None:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


@dataclasses.dataclass(frozen=True)
class Route:
    """Listen on ``listen`` (host, port), connect to ``target`` from ``source`` (or any)."""

    listen: tuple[str, int]
    target: tuple[str, int]
    source: str | None = None

    @classmethod
    def parse(cls, text: str) -> Route:
        """``HOST:PORT=HOST:PORT[@SOURCE]``."""
        spec, _, source = text.partition("@")
        left, _, right = spec.partition("=")
        lh, _, lp = left.rpartition(":")
        rh, _, rp = right.rpartition(":")
        return cls((lh, int(lp)), (rh, int(rp)), source or None)


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, count: list[int]
) -> None:
    """Copy ``reader`` to ``writer``; each chunk is written ``delay`` s after it was read."""
    loop = asyncio.get_running_loop()
    if delay <= 0:
        while data := await reader.read(1 << 18):
            count[0] += len(data)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()
        return
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=QUEUE_BYTES >> 18)

    async def read() -> None:
        while True:
            data = await reader.read(1 << 18)
            await queue.put((loop.time() + delay, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            count[0] += len(data)
            writer.write(data)
            await writer.drain()

    await asyncio.gather(read(), write())


async def _serve_route(route: Route, delay: float, rcvbuf: int = 0) -> asyncio.Server:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        local = (route.source, 0) if route.source else None
        try:
            up_r, up_w = await asyncio.open_connection(*route.target, local_addr=local)
        except OSError:
            client_w.close()
            return
        up, down = [0], [0]
        try:
            await asyncio.gather(
                _pipe(client_r, up_w, delay, up), _pipe(up_r, client_w, delay, down)
            )
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a peer hung up, or the relay stops
        finally:
            for w in (up_w, client_w):
                w.close()

    if not rcvbuf:
        return await asyncio.start_server(handle, *route.listen, reuse_address=True)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # accepted ones inherit it
    listener.bind(route.listen)
    return await asyncio.start_server(handle, sock=listener)


async def _sample(interfaces: list[str], log: Path, stop: asyncio.Event) -> None:
    """Every 0.1 s, each interface's byte counters, written when they changed."""
    last: dict[str, tuple[int, int]] = {}
    with open(log, "a", buffering=1, encoding="utf-8") as sink:
        while not stop.is_set():
            now = time.time()
            for name in interfaces:
                base = Path("/sys/class/net") / name / "statistics"
                try:
                    value = (
                        int((base / "rx_bytes").read_text()),
                        int((base / "tx_bytes").read_text()),
                    )
                except OSError:
                    continue
                if last.get(name) != value:
                    last[name] = value
                    sink.write(
                        json.dumps({"t": now, "if": name, "rx": value[0], "tx": value[1]}) + "\n"
                    )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)


async def _relay(
    routes: list[Route], delay: float, sample: list[str], log: Path | None, rcvbuf: int = 0
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    servers = [await _serve_route(route, delay, rcvbuf) for route in routes]
    print(json.dumps({"ready": True}), flush=True)
    if sample and log is not None:
        await _sample(sample, log, stop)
    else:
        await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    """``hub --port P --token T --log FILE`` or ``relay --route L=T[@S] ... [--delay-ms D]
    [--sample IF ... --log FILE]`` (run inside a namespace by :class:`LinkLab`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    hub = sub.add_parser("hub")
    hub.add_argument("--port", type=int, default=HUB_PORT)
    hub.add_argument("--token", required=True)
    hub.add_argument("--log", type=Path, required=True)
    relay = sub.add_parser("relay")
    relay.add_argument("--route", action="append", type=Route.parse, required=True)
    relay.add_argument("--delay-ms", type=float, default=0.0, help="added one-way latency")
    relay.add_argument("--sample", nargs="*", default=[], help="interfaces to sample")
    relay.add_argument("--log", type=Path, default=None)
    relay.add_argument(
        "--rcvbuf", type=int, default=0, help="SO_RCVBUF of the accepted connections (bytes)"
    )
    args = parser.parse_args(argv)
    if args.what == "hub":
        return serve_hub(args.port, args.token, args.log)
    asyncio.run(_relay(args.route, args.delay_ms / 1000.0, args.sample, args.log, args.rcvbuf))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
