"""The tables of ``bench/diloco_link.py``: one row per case with the issue's columns
(utilization as unshaped wall / wall, the loss against blocking's, the wall to a target loss),
each node's figures, what crosses the link per round, a round's anatomy, and the
recommendation line. The figures come from :mod:`link_report`."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def summarize(results: dict, args: object) -> dict:
    """One row per case (unshaped first) with the issue's columns, the target loss and the
    recommendation lines."""
    unshaped = results.get("unshaped", {})
    base = unshaped.get("fp32") or next(iter(unshaped.values()), {})
    target = getattr(args, "target_loss", None)
    if target is None and base.get("evals"):
        target = base["evals"][-1][2] * 1.02  # the round evals' held-out tokens
    cases = [*unshaped.values(), *results.get("shaped", [])]
    rows = []
    for case in cases:
        spec = case["case"]
        row = {
            "name": spec["name"],
            "link": spec["link"],
            "dtype": spec["dtype"],
            "sync": spec["sync"],
            "how": _how(spec),
            "mbit": case["rate_bps"] / 1e6 if case["rate_bps"] else None,
        }
        if "error" in case:
            rows.append(dict(row, error=case["error"]))
            continue
        nodes = case["nodes"]
        workers = [v for k, v in nodes.items() if k != "master"]
        twin = unshaped.get(spec["dtype"], {})
        ref = twin.get("wall_s")
        step = statistics.median(n["step_s"] for n in nodes.values())
        twin_nodes = twin.get("nodes", {}).values()
        twin_step = statistics.median(n["step_s"] for n in twin_nodes) if twin_nodes else None
        reached = [ts for _, ts, loss in case["evals"] if target is not None and loss <= target]
        row.update(
            wall_s=case["wall_s"],
            utilization=ref / case["wall_s"] if ref else None,
            node_utilization=_mean(n["utilization"] for n in nodes.values()),
            # the rounds alone: the start's and the end's one-time waits left out
            rounds_utilization=_mean(
                n["compute_s"] / (n["compute_s"] + n["boundary_s"]) for n in nodes.values()
            ),
            step_vs_unshaped=step / twin_step if twin_step else None,
            exchange_s=_mean(n["exchange_s"] for n in nodes.values()),
            sync_wait_s=_mean(n["sync_wait_s"] for n in nodes.values()),
            rounds=case["rounds"],
            loss=case["loss"],
            to_target_s=reached[0] if reached else None,
            traffic_vs_compute=case.get("traffic_vs_compute"),
            master_up_mb=nodes["master"]["wire_up_per_round"] / 1e6,
            master_down_mb=nodes["master"]["wire_down_per_round"] / 1e6,
            worker_up_mb=_mean(n["wire_up_per_round"] for n in workers) / 1e6,
            worker_down_mb=_mean(n["wire_down_per_round"] for n in workers) / 1e6,
            step_s=step,
            compute_per_round_s=case["compute_per_round_s"],
            round_latency_s=case["anatomy"]["median"]["last_worker_has_global"],
            wait_per_round_s=_mean(n["exchange_s"] for n in nodes.values())
            / max(case["rounds"], 1),
        )
        rows.append(row)
    for row in rows:
        peer = next(
            (
                r
                for r in rows
                if r["link"] == row["link"]
                and r["dtype"] == row["dtype"]
                and r["sync"] == "blocking"
                and r.get("loss")
            ),
            None,
        )
        if row.get("loss") and peer:
            row["loss_vs_blocking"] = row["loss"] / peer["loss"]
    tolerance = getattr(args, "quality_tolerance", 0.02)
    inner = getattr(args, "inner_steps", 20)
    advice = [recommend(rows, link, tolerance, inner) for link in ("fast", "slow")]
    return {"rows": rows, "target_loss": target, "recommendation": [a for a in advice if a]}


def _how(spec: dict) -> str:
    """A case's ``sync`` with the overlap settings it set (``overlapped`` alone: the config's)."""
    extra = [f"{key} {spec[key]}" for key in ("overlap_steps", "fragments") if spec.get(key)]
    return spec["sync"] + (f" ({', '.join(extra)})" if extra else "")


def recommend(rows: list[dict], link: str, tolerance: float, inner_steps: int) -> str | None:
    """Which ``sync``, dtype and ``inner_steps`` the measured figures favour at ``link``: the
    shortest wall among the cases whose loss is within ``tolerance`` of blocking fp32's (or
    the best blocking loss); ``inner_steps`` from the per-round wait of that dtype's blocking
    run (the exchange's length) and the step time."""
    here = [r for r in rows if r["link"] == link and r.get("loss")]
    blocking = [r for r in here if r["sync"] == "blocking"]
    if not blocking:
        return None
    ref = next(
        (r["loss"] for r in blocking if r["dtype"] == "fp32"), min(r["loss"] for r in blocking)
    )
    kept = [r for r in here if r["loss"] <= ref * (1 + tolerance)]
    best = min(kept, key=lambda r: r["wall_s"])
    peer = next((r for r in blocking if r["dtype"] == best["dtype"]), best)
    wait, step = peer["wait_per_round_s"], peer["step_s"]
    hide = max(1, math.ceil(wait / step))
    ninety = max(1, math.ceil(9 * wait / step))
    dropped = sorted(
        {f"{r['dtype']} {r['how']} ({r['loss'] / ref:.3f}x)" for r in here}
        - {f"{r['dtype']} {r['how']} ({r['loss'] / ref:.3f}x)" for r in kept}
    )
    text = (
        f"recommendation at {best['mbit']:.1f} Mbit/s: sync {best['how']}, delta_dtype and "
        f"global_dtype {best['dtype']} (wall {best['wall_s']:.0f} s, utilization "
        f"{best['utilization']:.2f}, loss {best['loss'] / ref:.3f}x blocking fp32); a round's "
        f"exchange keeps a blocking node {wait:.1f} s = {wait / step:.0f} steps of "
        f"{step:.2f} s, so inner_steps >= {ninety} gives blocking 90% utilization "
        f"(here {inner_steps}); overlapped hides it from inner_steps >= {hide} if its "
        "quality holds"
    )
    if dropped:
        text += f"; left out for quality (> {1 + tolerance:.2f}x): " + ", ".join(dropped)
    return text


def _fmt(value: object, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def render(results: dict, summary: dict) -> str:
    """The readable tables: the cases, each node, what crosses the link, a round's anatomy."""
    out = [f"link: {results['link']}; {results.get('calibration', '')}"]
    out.append(
        f"target loss {_fmt(summary['target_loss'], '.4f')}; util = unshaped wall / wall; "
        "node util = compute / wall per node; rounds util = compute / (compute + the waits at "
        "round boundaries) per node, the start's and the end's left out; step x = a step's "
        "time / the unshaped run's (the exchange's CPU beside the steps); "
        "wait = wall - compute per node; round latency = "
        "from a round's first upload to the last worker holding its global (median); "
        "traffic/compute = the busiest link direction's bytes of a "
        "round at the link rate / a round's compute, in this run"
    )
    head = (
        "case",
        "Mbit/s",
        "wall s",
        "util",
        "node util",
        "rounds util",
        "step x",
        "compute s/rd",
        "wait s/rd/node",
        "round latency s",
        "loss",
        "loss/blk",
        "to target s",
        "traffic/compute",
        "MB/rd master up/down",
        "MB/rd worker up/down",
    )
    out.append(" | ".join(head))
    for r in summary["rows"]:
        if "error" in r:
            out.append(f"{r['name']} | {_fmt(r['mbit'], '.1f')} | failed: {r['error']}")
            continue
        out.append(
            " | ".join(
                [
                    r["name"],
                    _fmt(r["mbit"], ".1f"),
                    _fmt(r["wall_s"], ".1f"),
                    _fmt(r["utilization"]),
                    _fmt(r["node_utilization"]),
                    _fmt(r["rounds_utilization"]),
                    _fmt(r["step_vs_unshaped"]),
                    _fmt(r["compute_per_round_s"], ".1f"),
                    _fmt(r["wait_per_round_s"], ".1f"),
                    _fmt(r["round_latency_s"], ".1f"),
                    _fmt(r["loss"], ".4f"),
                    _fmt(r.get("loss_vs_blocking"), ".3f"),
                    _fmt(r["to_target_s"], ".1f"),
                    _fmt(r["traffic_vs_compute"]),
                    f"{r['master_up_mb']:.1f}/{r['master_down_mb']:.1f}",
                    f"{r['worker_up_mb']:.1f}/{r['worker_down_mb']:.1f}",
                ]
            )
        )
    for case in [*results.get("unshaped", {}).values(), *results.get("shaped", [])]:
        if "error" in case:
            continue
        out.append(
            f"\n{case['case']['name']}: per node (s; MB a round: wire / HTTP bodies / events)"
        )
        for name, n in case["nodes"].items():
            t = case["traffic"][name]
            out.append(
                f"  {name}: compute {n['compute_s']:.1f} exchange {n['exchange_s']:.1f} (start "
                f"{n['start_s']:.1f} boundaries {n['boundary_s']:.1f} end {n['end_s']:.1f}; "
                f"sync_wait {n['sync_wait_s']:.1f}) util {n['utilization']:.2f} uploads "
                f"{n['uploads']} | up {n['wire_up_per_round'] / 1e6:.2f}/"
                f"{t['http_up_bytes'] / 1e6:.2f}/{n['event_up_per_round'] / 1e6:.2f} down "
                f"{n['wire_down_per_round'] / 1e6:.2f}/{t['http_down_bytes'] / 1e6:.2f}/"
                f"{n['event_down_per_round'] / 1e6:.2f} | {t['requests']:.0f} requests/round"
                + (
                    f" | reported wait {n['reported_wait_s']:.1f} compute "
                    f"{n['reported_compute_s']:.1f}"
                    if "reported_wait_s" in n
                    else ""
                )
            )
        m = case["anatomy"]["median"]
        out.append(
            f"  a round (median, s from its first upload's start): last upload starts "
            f"{_fmt(m['last_upload_start'], '.1f')}, arrives {_fmt(m['last_upload_end'], '.1f')}; "
            f"master's eval of the previous global ends {_fmt(m['previous_eval_end'], '.1f')}; "
            f"master reads {_fmt(m['close_start'], '.1f')}, publishes "
            f"{_fmt(m['publish_start'], '.1f')}-{_fmt(m['close_end'], '.1f')}; last worker has "
            f"the global {_fmt(m['last_worker_has_global'], '.1f')}; a round computes "
            f"{case['compute_per_round_s']:.1f}"
        )
        if "cpu" in case:
            c = case["cpu"]
            mine = ", ".join(f"{k} {v:.1f}" for k, v in c["nodes"].items())
            out.append(
                f"  CPU seconds: {mine}, Hub emulator {c['hub']:.1f}, relays {c['relays']:.1f}; "
                f"{c['total']:.1f} in all, {_fmt(c['busy'])} of {c['cores']} cores x the wall"
            )
        if "link_busy_s" in case:
            busy = ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in case["link_busy_s"].items())
            out.append(f"  seconds each link ran at >= half its rate (up/down): {busy}")
    for dtype in ("fp32", "int8"):
        case = results.get("unshaped", {}).get(dtype)
        if not case or "error" in case:
            continue
        out.append(
            f"\nwhat crosses the link per round per node ({dtype}, unshaped run; "
            "requests, MB up / down):"
        )
        for name, t in case["traffic"].items():
            kinds = "; ".join(
                f"{kind} {k['per_round']:.1f}x "
                f"{k['up_bytes'] / 1e6:.2f}/{k['down_bytes'] / 1e6:.2f}"
                for kind, k in t["kinds"].items()
                if k["up_bytes"] + k["down_bytes"] > 1e4 or k["per_round"] >= 1
            )
            out.append(f"  {name}: {kinds}")
    out.extend(["", *summary["recommendation"]])
    return "\n".join(out)
