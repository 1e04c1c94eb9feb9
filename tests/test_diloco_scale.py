"""Many nodes, CI-sized (issue 17): 16 simulated nodes with tiny deltas complete their rounds
through the real transports and round masters, every contribution counted exactly once, and
the group layout stays within the Hub's commit budget (enforced by the emulator) with room
for >= 10 rounds per hour, counted per repository and per token. bench/diloco_scale.py runs
the same simulation at K = 4, 16, 64 with a 26.2M-parameter shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from diloco_scale import HUB_COMMITS_PER_HOUR, model_shapes, simulate

from speedtronic.testing.hub_budget import Budget

TINY = model_shapes(16, 1, 64)
TARGET_ROUNDS_PER_HOUR = 10


@pytest.mark.slow
def test_sixteen_nodes_in_groups_stay_within_the_commit_budget_exactly_once():
    # The Hub's commit budget, enforced per repository, with an hour lasting 20 s: past it
    # the emulator answers 429 and the run would slow down (and show refusals).
    budget = Budget(commits_per_hour=HUB_COMMITS_PER_HOUR, commit_scope="repo", time_scale=180)
    row = simulate(16, "groups", rounds=3, shapes=TINY, group_size=4, latency=(0.0, 0.0),
                   poll=0.05, timeout=240, budget=budget)  # fmt: skip
    assert row["finished"] and row["exactly_once"], row
    assert row["rounds"] == 3 and row["groups"] == 4
    assert row["hub_commits_per_round_repo"] == 5  # G + 1, not K + 1
    assert row["hub_commits_per_round_max_token"] == 1
    assert row["emulator_budget_refusals"]["commit"] == 0
    assert row["rounds_per_hour_commit_budget_per_repo"] >= TARGET_ROUNDS_PER_HOUR
    assert row["rounds_per_hour_commit_budget_shared_token"] >= TARGET_ROUNDS_PER_HOUR


@pytest.mark.slow
def test_sixteen_direct_nodes_cost_a_commit_each_and_are_counted_exactly_once():
    row = simulate(16, "direct", rounds=2, shapes=TINY, latency=(0.0, 0.0), poll=0.05,
                   timeout=240)  # fmt: skip
    assert row["finished"] and row["exactly_once"], row
    assert row["hub_commits_per_round_repo"] == 17  # K + 1: the reason groups exist
    assert row["rounds_per_hour_commit_budget_per_repo"] < TARGET_ROUNDS_PER_HOUR
    assert row["rounds_per_hour_commit_budget_own_tokens"] == HUB_COMMITS_PER_HOUR
