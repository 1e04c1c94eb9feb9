"""issue 31 item 5: the worker-slot lease holds when the hosts' clocks disagree by a minute.

Two hosts share a slots directory whose locks do not reach each other (a network volume): the
holder's lease is the only sign of life. The holder is a real :class:`SlotClaim` whose wall
clock is 60 s ahead of or behind the claimant's; the claimant's clocks are fake and advance
only when it sleeps. A live holder (renewing on its own schedule) is never taken over,
whichever way the clocks are skewed; a dead one is taken over after one lease period of the
claimant's own time, never sooner, however old or new its ``renewed_at`` claims to be.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict
from pathlib import Path

import pytest

from speedtronic.slots import Lease, SlotClaim, claim_slot

LEASE = 30.0
SKEWS = [60.0, -60.0, 0.0, 3600.0, -3600.0]


class Host:
    """The claimant's time: wall and monotonic clocks, advanced only by its sleeps."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.slept = 0.0
        self.on_sleep: list = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        for hook in self.on_sleep:
            hook()


def holder_on_another_host(directory: Path, host: Host, skew: float) -> SlotClaim:
    """A live ``worker-1`` holder on a host whose clock is ``skew`` s off the claimant's: its
    life lock is on a kernel we cannot see (a lock fd of its own file), its lease names
    another boot id, and it renews every ``LEASE / 3`` s of its own time."""
    lease = Lease(
        slot="worker-1",
        instance=secrets.token_hex(8),
        hostname="host-b",
        boot_id="kernel-b",
        pid=4242,
        renewed_at=host.now + skew,
        lease_seconds=LEASE,
    )
    (directory / "worker-1.json").write_text(json.dumps(asdict(lease)))
    fd = os.open(directory / "host-b-private.lock", os.O_RDWR | os.O_CREAT, 0o600)
    return SlotClaim(directory, lease, fd, clock=lambda: host.now + skew)


def renewing(holder: SlotClaim, host: Host):
    """A sleep hook that renews the holder every ``LEASE / 3`` s (its own schedule)."""
    due = [host.now + LEASE / 3]

    def hook() -> None:
        while host.now >= due[0]:
            assert holder.renew()
            due[0] += LEASE / 3

    return hook


def claim(directory: Path, host: Host) -> SlotClaim:
    return claim_slot(
        directory,
        lease_seconds=LEASE,
        clock=host.clock,
        monotonic=host.clock,
        sleep=host.sleep,
        kernel="kernel-a",
    )


@pytest.mark.parametrize("skew", SKEWS)
def test_a_live_holder_on_a_skewed_host_keeps_its_slot(tmp_path, skew) -> None:
    host = Host()
    holder = holder_on_another_host(tmp_path, host, skew)
    host.on_sleep.append(renewing(holder, host))
    mine = claim(tmp_path, host)
    try:
        assert mine.node_id == "worker-2"
        assert Lease.read(tmp_path / "worker-1.json").instance == holder.lease.instance
        assert holder.renew() and not holder.lost  # the holder never noticed anything
    finally:
        mine.release()
        holder.release()


@pytest.mark.parametrize("skew", SKEWS)
def test_a_dead_holder_on_a_skewed_host_is_taken_over_after_one_lease(tmp_path, skew) -> None:
    host = Host()
    holder = holder_on_another_host(tmp_path, host, skew)
    dead = holder.lease
    os.close(holder._lock_fd)  # the host is gone: nothing renews the lease any more
    mine = claim(tmp_path, host)
    try:
        assert mine.node_id == "worker-1"
        assert mine.lease.instance != dead.instance
        assert LEASE <= host.slept <= 2 * LEASE  # one lease period of our own time, not 0 s
    finally:
        mine.release()


def test_a_holder_silent_for_less_than_a_lease_is_not_taken(tmp_path) -> None:
    """A holder that renews late (every 25 s of a 30 s lease) is still live."""
    host = Host()
    holder = holder_on_another_host(tmp_path, host, 60.0)
    due = [host.now + 25.0]

    def late() -> None:
        if host.now >= due[0]:
            holder.renew()
            due[0] += 25.0

    host.on_sleep.append(late)
    mine = claim(tmp_path, host)
    try:
        assert mine.node_id == "worker-2"
    finally:
        mine.release()
        holder.release()


def test_a_lease_from_before_beats_existed_is_read(tmp_path) -> None:
    host = Host()
    holder = holder_on_another_host(tmp_path, host, 0.0)
    data = json.loads((tmp_path / "worker-1.json").read_text())
    del data["beat"]
    (tmp_path / "worker-1.json").write_text(json.dumps(data))
    assert Lease.read(tmp_path / "worker-1.json").beat == 0
    assert holder.renew() and Lease.read(tmp_path / "worker-1.json").beat == 1
    holder.release()
