"""The emulator enforces the Hub's quotas (commits per hour per repository or per token, API
requests per window per token; time-scaled), and the transport waits them out without losing
or doubling a contribution (issue 17, item 4)."""

from __future__ import annotations

import time

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, upload_then_poll

from speedtronic.config import DistributedConfig
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.hub import HubClient
from speedtronic.diloco.master import RoundMaster
from speedtronic.retry import AccessRefused, RetryPolicy
from speedtronic.testing.hub_budget import Budget, BudgetKeeper
from speedtronic.testing.hub_server import HubEmulator


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_sliding_windows_per_repo_and_per_token():
    clock = Clock()
    keeper = BudgetKeeper(Budget(commits_per_hour=2, commit_scope="repo", time_scale=1.0), clock)
    assert keeper.commit("a/r", "t1") is None and keeper.commit("a/r", "t2") is None
    over = keeper.commit("a/r", "t3")  # the repository's third commit within the hour
    assert over is not None and over["RateLimit-Remaining"] == "0"
    assert float(over["Retry-After"]) == 3600.0 and over["RateLimit-Limit"] == "2"
    assert keeper.commit("b/r", "t1") is None  # another repository has its own budget
    clock.now = 3600.5
    assert keeper.commit("a/r", "t1") is None  # the window slid
    keeper.configure(commit_scope="token", time_scale=360.0)  # an hour lasts 10 s
    assert keeper.commit("x/1", "tok") is None and keeper.commit("x/2", "tok") is None
    over = keeper.commit("x/3", "tok")  # the token's third commit, whatever the repository
    assert over is not None and 0 < float(over["Retry-After"]) <= 10.0
    assert over["RateLimit-Reset"] == "3600"  # said in Hub seconds
    keeper.configure(requests_per_window=3, window_seconds=300.0)
    assert [keeper.request("tok") for _ in range(3)] == [None] * 3
    assert keeper.request("tok") is not None and keeper.request("other") is None
    assert keeper.refused == {"commit": 2, "request": 1}


def test_a_budgeted_hub_returns_429_and_every_contribution_is_aggregated_once(tmp_path):
    budget = Budget(commits_per_hour=4, commit_scope="repo", time_scale=1800.0)  # 4 per 2 s
    emulator = HubEmulator(0, token=TEST_TOKEN, budget=budget).start()
    try:
        retry = RetryPolicy(initial=0.05, maximum=1.0, attempts=12, timeout=10.0)
        hub = HubClient(
            "org/budget", token=TEST_TOKEN, endpoint=emulator.url, cache_dir=tmp_path, retry=retry
        )
        events = []
        master = RoundMaster(
            hub,
            {"w": torch.zeros(4)},
            settings=RoundSettings.of(
                DistributedConfig(outer_lr=1.0, outer_momentum=0.0, round_timeout=30.0)
            ),
            state_dir=tmp_path / "state",
            emit=lambda e, **fields: events.append((e, fields)),
        )
        hub.create_repo()
        master.reconcile()
        started = time.monotonic()
        # 3 uploads + 1 publish per round: past the budget every round
        upload_then_poll(hub, master, events, rounds=3, width=4)
        refused = emulator.stats()["budget_refused"]["commit"]
        assert refused > 0, "the budget never bit"
        assert time.monotonic() - started >= 1.5  # the 429s were waited out, not ignored
        rounds = [p for e, p in events if e == "outer_step"]
        included = [i for p in rounds for i in p["included"]]
        assert len(included) == 9 == len(set(included))
        expected = -sum(float(v) for v in range(1, 10)) / 3  # three rounds of node means
        assert torch.allclose(hub.read_global()["w"], torch.full((4,), expected))
    finally:
        emulator.stop()


def test_request_budget_per_token_and_several_tokens(tmp_path):
    budget = Budget(requests_per_window=5, window_seconds=300.0, time_scale=600.0)  # 0.5 s
    emulator = HubEmulator(0, tokens=("tok-a", "tok-b"), budget=budget).start()
    try:
        retry = RetryPolicy(initial=0.05, maximum=0.5, attempts=10, timeout=10.0)
        a = HubClient(
            "org/r", token="tok-a", endpoint=emulator.url, cache_dir=tmp_path, retry=retry
        )
        b = HubClient(
            "org/r", token="tok-b", endpoint=emulator.url, cache_dir=tmp_path, retry=retry
        )
        a.create_repo()
        for _ in range(8):
            a.list_files()  # past tok-a's 5 requests per window: waits, never fails
        assert emulator.stats()["budget_refused"]["request"] > 0
        before = emulator.stats()["budget_refused"]["request"]
        b.list_files()  # tok-b has its own window
        assert emulator.stats()["budget_refused"]["request"] == before
        wrong = HubClient(
            "org/r", token="tok-c", endpoint=emulator.url, cache_dir=tmp_path, retry=retry
        )
        # a token not on the list sees no repository: an access error naming it (issue 20),
        # no longer an empty exchange
        with pytest.raises(AccessRefused, match="org/r"):
            wrong.global_metadata()
    finally:
        emulator.stop()


def test_polling_the_global_costs_one_request_until_it_changes(tmp_path):
    """Cheap discovery (issue 17, item 3): a node's poll is one HEAD of the version record;
    it downloads only when the record changed, however many polls or files."""
    emulator = HubEmulator(0, token=TEST_TOKEN).start()
    try:
        retry = RetryPolicy(initial=0.05, maximum=1.0, attempts=4, timeout=10.0)
        writer = HubClient("org/poll", token=TEST_TOKEN, endpoint=emulator.url,
                           cache_dir=tmp_path / "w", retry=retry)  # fmt: skip
        writer.create_repo()
        writer.publish_global({"w": torch.zeros(4)}, outer_step=0, run_id="r")
        node = HubClient("org/poll", token=TEST_TOKEN, endpoint=emulator.url,
                         cache_dir=tmp_path / "n", retry=retry)  # fmt: skip

        def counts():
            c = emulator.stats()["counts"]
            return c.get("HEAD resolve", 0), c.get("GET resolve", 0)

        assert node.global_metadata().outer_step == 0
        head0, get0 = counts()
        for _ in range(10):
            assert node.global_metadata().outer_step == 0
        head1, get1 = counts()
        assert (head1 - head0, get1 - get0) == (10, 0)
        writer.publish_global({"w": torch.ones(4)}, outer_step=1, run_id="r")
        assert node.global_metadata().outer_step == 1  # a change is seen at the next poll
        head2, get2 = counts()
        assert get2 - get1 == 1 and head2 - head1 <= 2
    finally:
        emulator.stop()


def test_a_node_record_rewritten_unchanged_keeps_its_version_on_the_hub(tmp_path):
    """Each upload commit carries the node's record; while its status is unchanged the blob id
    stays, so the master (which re-reads a record only at a new version) reads none per round."""
    from speedtronic.diloco.link import NodeClaim

    emulator = HubEmulator(0, token=TEST_TOKEN).start()
    try:
        retry = RetryPolicy(initial=0.05, maximum=1.0, attempts=4, timeout=10.0)
        hub = HubClient("org/records", token=TEST_TOKEN, endpoint=emulator.url,
                        cache_dir=tmp_path, retry=retry)  # fmt: skip
        hub.create_repo()
        claim = NodeClaim("n1", "worker", tmp_path / "state")
        versions = []
        for _ in range(3):
            hub.claim_owner("n1", claim.record(state="training"))
            versions.append(hub.list_info()["nodes/n1/owner.json"].version)
        hub.claim_owner("n1", claim.record(state="done", final_round=2))
        done = hub.list_info()["nodes/n1/owner.json"].version
        assert versions[0] == versions[1] == versions[2] != done
    finally:
        emulator.stop()
