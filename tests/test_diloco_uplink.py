"""A background upload gives way to the foreground uploads of its process (issue 38).

The master sends a new run's global 0 (its weights file) after the record that names it while
the first rounds publish their updates; over a slow link the long upload took most of the
uplink and global 1's update waited behind it. ``Store.commit(background=True)`` (the Hub
store) now sends its files piece by piece, each waiting while a foreground request body is
being sent (for at most half of the call's timeout in all, a wait that does not count against
its deadline). The link bench measures what it does on a shaped link (docs/diloco.md).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from hub_emulator_fixtures import TEST_TOKEN, hub_emulator  # noqa: F401

from speedtronic.diloco import hub as uplink  # UPLINK and Uplink live in the Hub store
from speedtronic.diloco.hub import HubClient
from speedtronic.retry import RetryPolicy


def _client(emulator, tmp_path, timeout: float = 10.0) -> HubClient:
    retry = RetryPolicy(initial=0.01, maximum=0.05, attempts=1, timeout=timeout)
    client = HubClient(
        "org/uplink",
        token=TEST_TOKEN,
        endpoint=emulator.url,
        cache_dir=tmp_path / "cache",
        retry=retry,
    )
    client.create_repo()
    return client


def _file(tmp_path, name: str, size: int):
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path


@pytest.fixture
def foreground():
    """``foreground.start()`` holds the uplink as a foreground body being sent, until
    ``foreground.release()`` (or the test's end)."""

    class Held:
        def __init__(self) -> None:
            self._sending, self._release = threading.Event(), threading.Event()
            self._thread = threading.Thread(target=self._hold, daemon=True)

        def _hold(self) -> None:
            with uplink.UPLINK.sending():
                self._sending.set()
                self._release.wait(30)

        def start(self) -> None:
            self._thread.start()
            assert self._sending.wait(5) and uplink.UPLINK.busy

        def release(self) -> None:
            self._release.set()
            self._thread.join(5)

    held = Held()
    yield held
    held.release()


def _in_background(client: HubClient, additions) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def send() -> None:
        client.commit(additions, message="weights", background=True)
        done.set()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, done


def test_a_background_upload_waits_while_a_foreground_body_is_sent(
    hub_emulator,  # noqa: F811
    tmp_path,
    foreground,
) -> None:
    client = _client(hub_emulator, tmp_path, timeout=30.0)  # it may wait 15 s: it is released
    weights = _file(tmp_path, "weights.bin", 3 << 20)
    foreground.start()
    thread, done = _in_background(client, {"global/latest.safetensors": weights})
    assert not done.wait(1.5)  # it has not gone past its first piece
    assert "global/latest.safetensors" not in client.list_files()
    update = _file(tmp_path, "update.bin", 1 << 20)  # a foreground upload never waits
    client.commit({"global/update_1.safetensors": update}, message="outer step 1")
    assert not done.is_set()
    foreground.release()
    assert done.wait(10)
    thread.join(5)
    assert client.read_bytes("global/latest.safetensors") == weights.read_bytes()
    assert client.read_bytes("global/update_1.safetensors") == update.read_bytes()


def test_a_background_upload_waits_at_most_half_its_timeout(
    hub_emulator,  # noqa: F811
    tmp_path,
    foreground,
) -> None:
    """A link the foreground never leaves (here: a body that is never done) does not starve
    the background upload past its deadline: it waits half the call's timeout, then goes."""
    client = _client(hub_emulator, tmp_path, timeout=4.0)
    weights = _file(tmp_path, "weights.bin", 1 << 20)
    foreground.start()
    begun = time.monotonic()
    client.commit({"global/latest.safetensors": weights}, message="weights", background=True)
    took = time.monotonic() - begun
    assert 1.9 <= took < 10.0  # 2 s waited, then sent: not the 30 s the foreground lasts
    assert client.read_bytes("global/latest.safetensors") == weights.read_bytes()


def test_only_a_foreground_body_over_64_kib_holds_the_background_uploads(
    hub_emulator,  # noqa: F811
    tmp_path,
    monkeypatch,
) -> None:
    client = _client(hub_emulator, tmp_path)
    seen: list[str] = []
    original = uplink.Uplink.sending

    def sending(self):
        seen.append("sending")
        return original(self)

    monkeypatch.setattr(uplink.Uplink, "sending", sending)
    client.commit({"nodes/a/delta_0.safetensors": _file(tmp_path, "d", 200 << 10)})
    assert seen == ["sending"]  # the LFS upload of the file (its commit is small)
    client.commit({"global/step_count.json": b'{"outer_step": 1}'})
    client.commit({"nodes/a/delta_1.safetensors": _file(tmp_path, "s", 1 << 10)})
    client.commit({"global/latest.safetensors": _file(tmp_path, "w", 200 << 10)}, background=True)
    assert seen == ["sending"]  # records, small files and the background upload do not hold
