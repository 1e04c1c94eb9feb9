"""What ``bench/diloco_link.py`` reads back from a run: each node's events (its JSON log lines,
``logging.format: json``, every one stamped with the wall clock), the Hub emulator's request
log and the veth counters, turned into per-node figures, what crossed the link per round and
the anatomy of a round (where its exchange time goes).

Definitions (per node, from its events):

- ``wall_s``: from the start of its training loop (``train_end`` time - its ``elapsed_s``) to
  its last DiLoCo or step event (the final local eval and checkpoint are not counted).
- ``compute_s``: the sum of its step times, where a step that held the exchange (a round
  boundary, a scheduled merge: a ``round_done`` or ``sync_wait`` event in it; and the first
  step, which holds the wait for the first global) counts as a median ordinary step: the time
  in inner steps. ``exchange_s`` = ``wall_s`` - ``compute_s``: the training thread on the
  exchange (start, boundaries, end), split into ``start_s``, ``boundary_s`` and ``end_s``.
- ``sync_wait_s``: the ``sync_wait`` events (waits for a global); ``upload_s``: the
  ``delta_uploaded`` events' seconds (on the training thread when blocking).
- Per-round ``wait``/``compute`` seconds that a node reports itself in its events (fields
  ``wait_s``/``compute_s`` or ``wait_seconds``/``compute_seconds``) are summed as
  ``reported_wait_s``/``reported_compute_s`` when present.
"""

from __future__ import annotations

import bisect
import datetime as dt
import itertools
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from link_net import node_of_source

#: Events that belong to the DiLoCo exchange (the last one ends a node's wall).
EXCHANGE_EVENTS = {
    "delta_uploaded",
    "global_pulled",
    "sync_wait",
    "outer_step",
    "final_global",
    "diloco_final",
    "diloco_run_ended",
}


@dataclass
class Event:
    """One event of a node: wall-clock time (s), name, fields."""

    ts: float
    name: str
    fields: dict


def read_events(path: Path) -> list[Event]:
    """The events of a node's output (JSON log lines with ``event``; other lines skipped)."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "event" not in row or "ts" not in row:
            continue
        stamp = dt.datetime.fromisoformat(row["ts"].replace("Z", "+00:00")).timestamp()
        found.append(Event(stamp, row["event"], row.get("fields") or {}))
    return found


def _of(events: Iterable[Event], name: str) -> list[Event]:
    return [e for e in events if e.name == name]


def _reported(events: list[Event]) -> dict[str, float]:
    """Per-round wait/compute seconds the node's events report themselves (if any do)."""
    out: dict[str, float] = {}
    for wait, compute in (("wait_s", "compute_s"), ("wait_seconds", "compute_seconds")):
        rows = [e.fields for e in events if wait in e.fields and compute in e.fields]
        if rows:
            out["reported_wait_s"] = sum(float(r[wait]) for r in rows)
            out["reported_compute_s"] = sum(float(r[compute]) for r in rows)
            out["reported_in"] = sorted({e.name for e in events if wait in e.fields})
            break
    return out


def node_figures(events: list[Event], inner_steps: int) -> dict:
    """The per-node figures of the module docstring."""
    steps = _of(events, "train_step")
    ends = _of(events, "train_end")
    if not steps or not ends:
        return {"error": "no train_step/train_end events"}
    start = ends[-1].ts - float(ends[-1].fields["elapsed_s"])
    last = max(e.ts for e in events if e.name in EXCHANGE_EVENTS | {"train_step"})
    times = [float(e.fields["step_time_s"]) for e in steps]
    numbers = [int(e.fields["step"]) for e in steps]
    # a step that held the exchange: a boundary (round_done) or a scheduled merge (sync_wait),
    # whatever the round's length (fragments) and the merge's step (overlap_steps)
    held = sorted(e.ts for e in events if e.name in ("round_done", "sync_wait"))
    edges = [steps[0].ts - float(times[0]), *(e.ts for e in steps)]
    special = [
        n == 1
        or n % inner_steps == 0
        or bisect.bisect_right(held, edges[i + 1]) > bisect.bisect_right(held, edges[i])
        for i, n in enumerate(numbers)
    ]
    plain = [t for t, s in zip(times, special, strict=True) if not s] or times
    base = statistics.median(plain)
    start_s = max(0.0, times[0] - base) if numbers[0] == 1 else 0.0
    boundary_s = sum(
        max(0.0, t - base) for t, s, n in zip(times, special, numbers, strict=True) if s and n != 1
    )
    compute = sum(t if not s else min(t, base) for t, s in zip(times, special, strict=True))
    wall = last - start
    uploads = _of(events, "delta_uploaded")
    pulled = [e for e in _of(events, "global_pulled") if e.fields.get("source") != "local"]
    figures = {
        "steps": len(steps),
        "step_s": base,
        "wall_s": wall,
        "compute_s": compute,
        "exchange_s": wall - compute,
        "start_s": start_s,
        "boundary_s": boundary_s,
        "end_s": max(0.0, last - steps[-1].ts),
        "sync_wait_s": sum(float(e.fields["seconds"]) for e in _of(events, "sync_wait")),
        "sync_timeouts": sum(bool(e.fields.get("timed_out")) for e in _of(events, "sync_wait")),
        "upload_s": sum(float(e.fields["seconds"]) for e in uploads),
        "utilization": compute / wall if wall > 0 else None,
        "uploads": len(uploads),
        "event_bytes_up": sum(int(e.fields.get("bytes", 0)) for e in uploads),
        "event_bytes_down": sum(int(e.fields.get("bytes", 0)) for e in pulled),
        "globals_pulled": {
            src: sum(e.fields.get("source") == src for e in pulled)
            for src in sorted({str(e.fields.get("source")) for e in pulled})
        },
        "start_ts": start,
        "end_ts": last,
    }
    figures.update(_reported(events))
    return figures


# -- what crossed the link ---------------------------------------------------------------------
def read_requests(path: Path) -> list[dict]:
    """The emulator's request log (one JSON object a line)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_DELTA = re.compile(r"nodes/([^/]+)/delta_(\d+)")


def _label(path: str, own: str | None) -> str:
    """What a repository file is, seen from node ``own``."""
    found = _DELTA.search(path)
    if found:
        return "own delta" if found.group(1) == own else "other's delta"
    if path.startswith("global/update"):  # update_<k>.safetensors (update.safetensors before)
        return "global update"
    names = {
        "global/latest.safetensors": "global weights",
        "global/step_count.json": "version record",
        "global/processed.json": "ledger",
        "global/moments.safetensors": "moments",
    }
    if path in names:
        return names[path]
    if path.endswith("owner.json"):
        return "status record"
    return "other file"


def _delta_round(row: dict, oids: dict[str, str]) -> int | None:
    """The round of the contribution request ``row`` reads (None: not a contribution)."""
    path = row["path"]
    if row.get("storage") and "/lfs-objects/" in path:
        path = oids.get(path.split("/lfs-objects/", 1)[1].split("/", 1)[0], "")
    found = _DELTA.search(path)
    return int(found.group(2)) if found else None


def _oid_paths(requests: list[dict]) -> dict[str, str]:
    """LFS object id -> repository path, from the commits' ``lfsFile`` entries."""
    found = {}
    for row in requests:
        for item in row.get("commit", []):
            if item.get("oid"):
                found[item["oid"]] = item["path"]
    return found


def classify(row: dict, oids: dict[str, str], own: str | None) -> str:
    """A short name for what request ``row`` did (``upload global weights``, ``listing``)."""
    path, method = row["path"], row["method"]
    if row.get("storage") and "/lfs-objects/" in path:
        oid = path.split("/lfs-objects/", 1)[1].split("/", 1)[0]
        what = _label(oids.get(oid, ""), own) if oid in oids else "lfs object"
        return f"{'upload' if method == 'PUT' else 'download'} {what} (lfs)"
    if "/resolve/" in path:
        what = _label(path.split("/resolve/", 1)[1].split("/", 1)[-1], own)
        if method == "HEAD":
            return f"metadata of {what}"
        return f"redirect to {what}" if row.get("status") == 302 else f"download {what}"
    if "/commit/" in path:
        inline = [i for i in row.get("commit", []) if i.get("kind") == "file"]
        big = [i for i in row.get("commit", []) if i.get("kind") != "deleted"]
        main = max(big, key=lambda i: i.get("size") or 0, default=None)
        if main is None:
            return "commit (deletions)"
        how = "inline" if main in inline else "pointer"
        return f"commit {_label(main['path'], own)} ({how})"
    for needle, name in (
        ("/tree/", "listing"),
        ("/preupload/", "preupload"),
        ("/info/lfs/objects/batch", "lfs batch"),
        ("/verify", "lfs verify"),
        ("/_lfs/complete", "lfs complete"),
        ("/revision/", "repo info"),
        ("/repos/create", "create repo"),
        ("/whoami", "whoami"),
    ):
        if needle in path:
            return name
    return f"{method} {path}"


def traffic(requests: list[dict], names: list[str], rounds: int) -> dict[str, dict]:
    """Per node: per kind of request, how many a round and the HTTP body bytes up and down a
    round; and the totals a round."""
    oids = _oid_paths(requests)
    table: dict[str, dict] = {}
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for row in requests:
        index = node_of_source(row["client"])
        if index is None or index >= len(names):
            continue
        node = names[index]
        cell = per[node][classify(row, oids, node)]
        cell[0] += 1
        cell[1] += int(row.get("in", 0))
        cell[2] += int(row.get("out", 0))
    r = max(rounds, 1)
    for node in names:
        kinds = {
            kind: {"per_round": n / r, "up_bytes": up / r, "down_bytes": down / r}
            for kind, (n, up, down) in sorted(per[node].items())
        }
        table[node] = {
            "kinds": kinds,
            "requests": sum(k["per_round"] for k in kinds.values()),
            "http_up_bytes": sum(k["up_bytes"] for k in kinds.values()),
            "http_down_bytes": sum(k["down_bytes"] for k in kinds.values()),
        }
    return table


# -- the anatomy of a round --------------------------------------------------------------------
def anatomy(
    nodes: dict[str, list[Event]], master: str, requests: list[dict], names: list[str]
) -> list[dict]:
    """Per closed round (the master's ``outer_step`` events), in seconds from the start of the
    round's first upload (``delta_uploaded`` time - its seconds): when the last upload
    started and arrived; when the master's evaluation of the previous global ended (its
    ``eval`` event: the master thread polls again only after it); when the master began
    reading the round's contributions (its first download of one, in the poll that lists it
    since issue 38 item 2, at the close before; the close's start when it read none),
    began publishing (its first request after the close began and its last read of a delta:
    the reads and the outer step lie between) and ended; when the last worker had the round's
    global (its ``global_pulled``). A download's end is taken from the next request, not the
    emulator's log: the relays and socket buffers hold the bytes."""
    rows = []
    oids = _oid_paths(requests)
    mine = [q for q in requests if node_of_source(q["client"]) == names.index(master)]
    evals = {
        int(e.fields["outer_step"]): e.ts
        for e in _of(nodes[master], "eval")
        if e.fields.get("scope") == "global"
    }
    for close in _of(nodes[master], "outer_step"):
        r, step = int(close.fields["round"]), int(close.fields["outer_step"])
        ups = [
            e
            for events in nodes.values()
            for e in _of(events, "delta_uploaded")
            if int(e.fields["round"]) == r
        ]
        if not ups:
            continue
        t0 = min(e.ts - float(e.fields["seconds"]) for e in ups)
        pulled = [
            e.ts
            for name, events in nodes.items()
            if name != master
            for e in _of(events, "global_pulled")
            if int(e.fields["outer_step"]) == step
        ]
        start = close.ts - float(close.fields["seconds"])
        reads = [
            q
            for q in mine
            if t0 - 0.2 <= q["t0"] <= close.ts
            and classify(q, oids, master).startswith("download")
            and _delta_round(q, oids) == r
        ]
        last_read = max([start - 0.2, *(q["t0"] for q in reads)])
        after = [
            q["t0"]
            for q in mine
            if last_read < q["t0"] <= close.ts
            and not classify(q, oids, master).startswith(("metadata", "download"))
        ]
        publish = min(after) if after else None
        rows.append(
            {
                "round": r,
                "last_upload_start": max(e.ts - float(e.fields["seconds"]) for e in ups) - t0,
                "last_upload_end": max(e.ts for e in ups) - t0,
                "previous_eval_end": evals[step - 1] - t0 if step - 1 in evals else None,
                "close_start": min([start, *(q["t0"] for q in reads)]) - t0,
                "publish_start": publish - t0 if publish is not None else None,
                "close_end": close.ts - t0,
                "last_worker_has_global": (max(pulled) - t0) if pulled else None,
                "deltas_read": len(reads),
            }
        )
    return rows


ANATOMY = (
    "last_upload_start",
    "last_upload_end",
    "previous_eval_end",
    "close_start",
    "publish_start",
    "close_end",
    "last_worker_has_global",
)


def median_anatomy(rows: list[dict]) -> dict:
    """The median of each field over the rounds (the last round left out when there are
    more: it meets the end of the run)."""
    use = rows[:-1] if len(rows) > 2 else rows
    out = {}
    for key in ANATOMY:
        values = [row[key] for row in use if row.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def cpu_shares(cpu: dict[str, float], names: list[str], cores: int, wall: float) -> dict:
    """Where the machine's CPU went in one case: each node's seconds, the emulator's, the
    relays' (the bench's own forwarding: no deployment runs them), their total and the
    fraction of ``cores`` x ``wall`` it filled (near 1: the nodes' steps and the exchange
    took turns on the cores)."""
    nodes = {name: round(cpu.get(name, 0.0), 1) for name in names}
    relays = sum(v for k, v in cpu.items() if k not in names and k != "hub")
    total = sum(cpu.values())
    return {
        "nodes": nodes,
        "hub": round(cpu.get("hub", 0.0), 1),
        "relays": round(relays, 1),
        "total": round(total, 1),
        "busy": round(total / (cores * wall), 2) if cores and wall else None,
        "cores": cores,
    }


def counter_series(path: Path) -> dict[str, list[tuple[float, int, int]]]:
    """The sampled veth counters: ``{interface: [(time, rx, tx), ...]}``."""
    series: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            series[row["if"]].append((row["t"], row["rx"], row["tx"]))
    return dict(series)


def busy_seconds(points: list[tuple[float, int, int]], column: int, rate_bps: float) -> float:
    """Seconds in which the interface moved at least half its rate in direction ``column``
    (1: rx, 2: tx), from the 0.1 s samples: how long the link was the bottleneck."""
    busy = 0.0
    for (t0, *a), (t1, *b) in itertools.pairwise(points):
        span = t1 - t0
        if span > 0 and (b[column - 1] - a[column - 1]) * 8 / span >= 0.5 * rate_bps:
            busy += span
    return busy
