"""bench/diloco_churn.py's bookkeeping (issue 40, item 4): the schedule it reads and the
ledger check it reports, without starting a node (the bench itself runs for minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from diloco_churn import ledger_check, parse_schedule  # noqa: E402
from link_report import Event  # noqa: E402


def test_the_schedule_is_read_in_the_order_of_its_rounds():
    events = parse_schedule("join:w6@10,kill:w1@4, term:w2@7")
    assert [(e["kind"], e["node"], e["at"]) for e in events] == [
        ("kill", "w1", 4),
        ("term", "w2", 7),
        ("join", "w6", 10),
    ]
    with pytest.raises(SystemExit, match="not one of"):
        parse_schedule("pause:w1@3")
    with pytest.raises(SystemExit, match="KIND:NODE@ROUND"):
        parse_schedule("kill-w1-3")


def test_the_ledger_check_finds_a_contribution_aggregated_twice_or_lost():
    closes = [
        Event(0.0, "outer_step", {"included": ["a/0", "b/0"], "dropped": []}),
        Event(1.0, "outer_step", {"included": ["a/1"], "dropped": ["b/1"], "deltas_skipped": 1}),
    ]
    fine = ledger_check({"a": {0, 1}, "b": {0, 1}}, closes)
    assert fine["ok"] and fine["stale"] == 1 and fine["skipped_replays"] == 1
    closes.append(Event(2.0, "outer_step", {"included": ["a/1"], "dropped": []}))
    twice = ledger_check({"a": {0, 1, 2}, "b": {0, 1}}, closes)
    assert not twice["ok"] and twice["twice"] == ["a/1"] and twice["lost"] == ["a/2"]
