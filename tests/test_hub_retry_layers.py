# ruff: noqa: F811  (pytest fixtures imported from hub_emulator_fixtures)
"""One retry layer against the Hub emulator (issue 12 rows 1 and 15).

huggingface_hub retries 408/429/5xx, timeouts and dropped connections inside its own calls
(1, 2, 4, 8, 8 s), which nested inside our RetryPolicy made one of our attempts last 23 s of
SDK sleeps and printed ``Retrying in ...`` lines. Here every injected fault is seen exactly
once per attempt of ours, only our sleeper sleeps (it honours Retry-After), the SDK logs no
retry lines, and ``request_timeout`` bounds a whole call (HEAD + GET), not each request.
"""

from __future__ import annotations

import logging
import time

import pytest
from hub_emulator_fixtures import TEST_TOKEN, hub_emulator  # noqa: F401

from speedtronic.diloco.hub import HubClient
from speedtronic.retry import HubUnavailable, RetryPolicy, TransportError


def _client(hub_emulator, tmp_path, sleeps, *, attempts=3, timeout=5.0, token=TEST_TOKEN):
    policy = RetryPolicy(
        initial=0.01, maximum=0.02, attempts=attempts, timeout=timeout, sleeper=sleeps.append
    )
    client = HubClient(
        "org/layers", token=token, endpoint=hub_emulator.url, cache_dir=tmp_path, retry=policy
    )
    return client


def _ready(hub_emulator, tmp_path):
    client = _client(hub_emulator, tmp_path, [])
    client.create_repo()
    # a file the repository's .gitattributes does not track: it stays in git (resolve serves it)
    client.commit({"a.dat": b"x" * 4096, "global/step_count.json": b"{}"})
    return client


def _counts(hub_emulator) -> dict[str, int]:
    return dict(hub_emulator.stats()["counts"])


def _delta(before: dict[str, int], after: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


OPERATIONS = {
    "tree": lambda c: c.list_files(),
    "resolve": lambda c: c.read_bytes("a.dat"),
    "commit": lambda c: c.commit({"b.bin": b"y"}),
}


@pytest.mark.parametrize("endpoint", sorted(OPERATIONS))
@pytest.mark.parametrize("fault", ["error_rate", "drop_rate"])
def test_each_fault_is_seen_once_per_attempt_of_ours(
    hub_emulator, tmp_path, caplog, endpoint, fault
) -> None:
    _ready(hub_emulator, tmp_path)
    sleeps: list[float] = []
    client = _client(hub_emulator, tmp_path, sleeps, attempts=3)
    hub_emulator.set_faults(**{fault: 1.0}, endpoints=endpoint)
    before = _counts(hub_emulator)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="huggingface_hub"),
        pytest.raises(HubUnavailable, match="after 3 attempts"),
    ):
        OPERATIONS[endpoint](client)
    elapsed = time.monotonic() - started
    injected = _delta(before, _counts(hub_emulator), f"fault:{fault.split('_')[0]}")
    assert injected == 3, injected  # 3 attempts of ours, no SDK retries inside them (was 18)
    assert len(sleeps) == 2 and elapsed < 3.0, (sleeps, elapsed)
    sdk_lines = [r.getMessage() for r in caplog.records if r.name.startswith("huggingface_hub")]
    assert not [line for line in sdk_lines if "Retry" in line or "thrown while" in line]


def test_429_retry_after_is_honoured_by_our_layer_only(hub_emulator, tmp_path) -> None:
    _ready(hub_emulator, tmp_path)
    sleeps: list[float] = []
    client = _client(hub_emulator, tmp_path, sleeps, attempts=2)
    hub_emulator.set_faults(rate_limit_rate=1.0, retry_after=7, endpoints="tree")
    started = time.monotonic()
    with pytest.raises(HubUnavailable):
        client.list_files()
    assert sleeps == [7.0]  # our sleeper got Retry-After ...
    assert time.monotonic() - started < 3.0  # ... and the SDK did not sleep 8 s on its own


def test_request_timeout_bounds_a_whole_call(hub_emulator, tmp_path) -> None:
    _ready(hub_emulator, tmp_path)
    client = _client(hub_emulator, tmp_path, [], attempts=1, timeout=1.0)
    # HEAD and GET each answer after 0.7 s: each request is within the timeout, the call is not
    hub_emulator.set_faults(slow_rate=1.0, slow_seconds=0.7, endpoints="resolve")
    started = time.monotonic()
    with pytest.raises(HubUnavailable, match=r"timed out|timeout"):
        client.read_bytes("a.dat")
    assert time.monotonic() - started < 1.5
    hub_emulator.set_faults(slow_rate=0.0)
    assert client.read_bytes("a.dat") == b"x" * 4096


def test_a_call_deadline_grows_with_bytes_moved() -> None:
    from speedtronic.diloco import hub as hub_http

    with hub_http.hub_call(2.0):
        call = hub_http._CALL.get()
        left = call.left()
        call.moved(10 * hub_http.BYTES_PER_SECOND)
        assert 11.0 < call.left() <= left + 10.0
    assert hub_http._CALL.get() is None


@pytest.mark.parametrize("pad", ["\n", "\r\n", "\t"])
def test_a_token_with_surrounding_whitespace_reaches_the_hub(hub_emulator, tmp_path, pad) -> None:
    _ready(hub_emulator, tmp_path)
    client = _client(hub_emulator, tmp_path, [], token=TEST_TOKEN + pad)
    assert "a.dat" in client.list_files()
    assert client.read_bytes("a.dat") == b"x" * 4096


def test_a_rejected_token_is_a_clear_permanent_error(hub_emulator, tmp_path) -> None:
    bad = "hf_rejectedToken0123456789abcdefghij"
    client = _client(hub_emulator, tmp_path, sleeps := [], token=bad + "\n")
    with pytest.raises(TransportError) as info:
        client.create_repo()
    message = str(info.value)
    assert info.value.kind == "permanent" and info.value.status == 401
    assert "rejected the token (HTTP 401)" in message and "HF_TOKEN" in message
    assert bad not in message and "rejectedToken" not in message
    assert sleeps == []  # never retried
    anonymous = _client(hub_emulator, tmp_path, [], token=None)
    with pytest.raises(TransportError, match="requires a token and none is configured"):
        anonymous.create_repo()
