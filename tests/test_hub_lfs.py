"""The Hub's large-file path in the emulator, driven by the real huggingface_hub client and by
the Hub store (issue 22, item 1): preupload answers ``lfs`` from the threshold on, the LFS
batch endpoint, uploads (basic and multipart) to and downloads from a storage origin the Hub
redirects to, commits of LFS pointers, and every fault knob on the storage requests."""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, upload_then_poll

from speedtronic.config import DistributedConfig
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.hub import HubClient
from speedtronic.diloco.master import RoundMaster
from speedtronic.retry import HubUnavailable, RetryPolicy
from speedtronic.testing.hub_server import FaultConfig, HubEmulator, LfsConfig

THRESHOLD = 4096


@pytest.fixture
def lfs_hub():
    """An emulator whose files of ``THRESHOLD`` bytes or more take the LFS path."""
    emulator = HubEmulator(
        0, token=TEST_TOKEN, faults=FaultConfig(seed=7), lfs=LfsConfig(threshold=THRESHOLD)
    ).start()
    try:
        yield emulator
    finally:
        emulator.stop()


def _api(emulator: HubEmulator):
    from huggingface_hub import HfApi

    api = HfApi(endpoint=emulator.url, token=TEST_TOKEN)
    api.create_repo("org/lfs", private=True, exist_ok=True)
    return api


def _add(path: str, data: bytes):
    from huggingface_hub import CommitOperationAdd

    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=io.BytesIO(data))


def _counts(emulator: HubEmulator) -> dict[str, int]:
    return dict(emulator.stats()["counts"])


def _store(emulator: HubEmulator, tmp_path: Path, sleeps: list | None = None, **policy):
    settings = {"initial": 0.01, "maximum": 0.02, "attempts": 3, "timeout": 5.0, **policy}
    sleeper = sleeps.append if sleeps is not None else (lambda seconds: None)
    retry = RetryPolicy(**settings, sleeper=sleeper)
    hub = HubClient(
        "org/lfs", token=TEST_TOKEN, endpoint=emulator.url, cache_dir=tmp_path, retry=retry
    )
    hub.create_repo()
    return hub


def test_preupload_answers_lfs_from_the_threshold_on(lfs_hub, tmp_path) -> None:
    api = _api(lfs_hub)  # names the new repository's .gitattributes does not track
    below, at = b"b" * (THRESHOLD - 1), bytes(range(256)) * (THRESHOLD // 256)
    api.create_commit(
        "org/lfs", operations=[_add("below.dat", below), _add("at.dat", at)], commit_message="m"
    )
    counts = _counts(lfs_hub)
    assert lfs_hub.stats()["lfs_files"]["org/lfs"] == ["at.dat"]  # below stayed in git
    assert counts["POST lfs-batch"] == 1 and counts["PUT storage-upload"] == 1
    assert counts["POST lfs-verify"] == 1 and counts["POST commit"] == 1
    tree = {f.path: f for f in api.list_repo_tree("org/lfs")}
    assert tree["below.dat"].lfs is None and tree["at.dat"].size == THRESHOLD
    assert tree["at.dat"].lfs.size == THRESHOLD and len(tree["at.dat"].lfs.sha256) == 64
    for name, data in (("below.dat", below), ("at.dat", at)):
        local = api.hf_hub_download("org/lfs", name, local_dir=tmp_path / "dl")
        assert Path(local).read_bytes() == data
    counts = _counts(lfs_hub)
    assert counts["GET storage-download"] == 1  # only the LFS file came from storage
    assert counts.get("PUT storage:auth", 0) + counts.get("GET storage:auth", 0) == 0


def test_preupload_answers_lfs_for_what_the_repositorys_gitattributes_tracks(
    lfs_hub, tmp_path
) -> None:
    """As the Hub: a new repository's .gitattributes tracks *.safetensors (and *.bin, ...)
    with LFS, so a small contribution takes the LFS path (no base64 in the commit); a path it
    does not track goes by size; a repository can change what its .gitattributes tracks."""
    hub = _store(lfs_hub, tmp_path)
    assert hub.read_bytes(".gitattributes").count(b"filter=lfs") > 30
    small = b"s" * 100
    hub.commit({"nodes/a/delta_0.safetensors": small, "nodes/a/owner.json": b"{}"})
    assert lfs_hub.stats()["lfs_files"]["org/lfs"] == ["nodes/a/delta_0.safetensors"]
    assert hub.read_bytes("nodes/a/delta_0.safetensors") == small
    hub.commit({".gitattributes": b"*.bin filter=lfs diff=lfs merge=lfs -text\n"})
    hub.commit({"nodes/a/delta_1.safetensors": small, "w.bin": b"w"})
    assert lfs_hub.stats()["lfs_files"]["org/lfs"] == ["nodes/a/delta_0.safetensors", "w.bin"]
    plain = HubEmulator(0, token=TEST_TOKEN, lfs=LfsConfig(gitattributes="")).start()
    try:  # a repository created without .gitattributes: small files stay in git
        other = _store(plain, tmp_path / "plain")
        other.commit({"nodes/a/delta_0.safetensors": small})
        assert plain.stats()["lfs_files"]["org/lfs"] == []
        assert other.list_files() == ["nodes/a/delta_0.safetensors"]
    finally:
        plain.stop()


def test_multipart_upload_then_a_redirected_download(lfs_hub, tmp_path) -> None:
    lfs_hub.lfs.config.part_size = 1500
    api = _api(lfs_hub)
    data = torch.arange(1500, dtype=torch.int32).numpy().tobytes()  # 6000 bytes: 4 parts
    api.create_commit("org/lfs", operations=[_add("big.bin", data)], commit_message="m")
    counts = _counts(lfs_hub)
    assert counts["PUT storage-upload"] == 4 and counts["POST lfs-complete"] == 1
    meta = api.get_hf_file_metadata(url=f"{lfs_hub.url}/org/lfs/resolve/main/big.bin")
    assert meta.size == len(data) and meta.location.startswith(lfs_hub.storage_url)
    local = api.hf_hub_download("org/lfs", "big.bin", local_dir=tmp_path / "dl")
    assert Path(local).read_bytes() == data
    # the same content again: the batch answer has no upload action, nothing is sent
    api.create_commit("org/lfs", operations=[_add("copy.bin", data)], commit_message="m")
    assert _counts(lfs_hub)["PUT storage-upload"] == 4
    assert lfs_hub.files("org/lfs")["copy.bin"] == data


def _request(url: str, method: str = "GET", body: bytes | None = None, headers=None):
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_storage_is_signed_and_refuses_the_hub_token(lfs_hub) -> None:
    api = _api(lfs_hub)
    data = b"s" * THRESHOLD
    api.create_commit("org/lfs", operations=[_add("f.bin", data)], commit_message="m")
    url = lfs_hub.lfs.download_url(next(iter(lfs_hub.lfs.objects)))
    assert _request(url) == (200, data)
    assert _request(url.split("?")[0])[0] == 403  # unsigned
    auth = {"Authorization": f"Bearer {TEST_TOKEN}"}
    assert _request(url, headers=auth)[0] == 400
    assert _counts(lfs_hub)["GET storage:auth"] == 1
    # an upload without a length (chunked transfer encoding) is read whole
    body = b"c" * 5000
    oid = hashlib.sha256(body).hexdigest()
    address = urllib.parse.urlsplit(lfs_hub.storage_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=5)
    path = f"/lfs-objects/{oid}?sig={lfs_hub.lfs.sign('upload', oid)}"
    connection.request("PUT", path, body=iter([body[:1234], body[1234:]]), encode_chunked=True)
    assert connection.getresponse().status == 200 and lfs_hub.lfs.stored(oid) == body
    connection.close()


def _pointer_commit(emulator: HubEmulator, path: str, oid: str, size: int | None = None):
    """Commit an LFS pointer as the SDK sends it (NDJSON ``lfsFile``), nothing uploaded."""
    pointer = {"path": path, "algo": "sha256", "oid": oid}
    if size is not None:
        pointer["size"] = size
    lines = [
        {"key": "header", "value": {"summary": "m", "description": ""}},
        {"key": "lfsFile", "value": pointer},
    ]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return _request(
        f"{emulator.url}/api/models/org/lfs/commit/main",
        "POST",
        body,
        {"Authorization": f"Bearer {TEST_TOKEN}", "Content-Type": "application/x-ndjson"},
    )


def test_a_pointer_to_an_object_never_uploaded_is_refused(lfs_hub) -> None:
    _api(lfs_hub)
    status, _ = _pointer_commit(lfs_hub, "x.bin", "0" * 64)
    assert status == 422 and "x.bin" not in lfs_hub.files("org/lfs")


def test_objects_no_file_points_to_are_released(lfs_hub, tmp_path) -> None:
    """The emulator keeps no history: a long run must not hold every delta ever sent. A
    released object stays committable for release_after seconds (a client told "stored"
    just before may still point to it), then it is gone and identical content is sent again."""
    from huggingface_hub import CommitOperationDelete

    api = _api(lfs_hub)
    data = b"r" * THRESHOLD
    oid = hashlib.sha256(data).hexdigest()
    api.create_commit("org/lfs", operations=[_add("a.bin", data)], commit_message="m")
    delete = [CommitOperationDelete(path_in_repo="a.bin")]
    api.create_commit("org/lfs", operations=delete, commit_message="m")
    assert lfs_hub.stats()["lfs_objects"] == 0 and lfs_hub.lfs.stored(oid) == data
    status, _ = _pointer_commit(lfs_hub, "again.bin", oid, len(data))
    assert status == 200 and lfs_hub.files("org/lfs")["again.bin"] == data  # live again
    assert lfs_hub.stats()["lfs_objects"] == 1
    lfs_hub.lfs.config.release_after = 0.0
    api.create_commit(
        "org/lfs", operations=[CommitOperationDelete(path_in_repo="again.bin")], commit_message="m"
    )
    assert lfs_hub.lfs.stored(oid) is None
    assert _pointer_commit(lfs_hub, "late.bin", oid, len(data))[0] == 422
    puts = _counts(lfs_hub)["PUT storage-upload"]
    api.create_commit("org/lfs", operations=[_add("b.bin", data)], commit_message="m")
    assert _counts(lfs_hub)["PUT storage-upload"] == puts + 1  # sent again
    local = api.hf_hub_download("org/lfs", "b.bin", local_dir=tmp_path / "dl")
    assert Path(local).read_bytes() == data


def _upload(hub: HubClient) -> None:
    hub.commit({"big.bin": b"u" * (2 * THRESHOLD)})


def _download(hub: HubClient) -> None:
    assert hub.read_bytes("big.bin") == b"u" * (2 * THRESHOLD)


@pytest.mark.parametrize("fault", ["error_rate", "drop_rate"])
@pytest.mark.parametrize("endpoint", ["storage-upload", "storage-download", "lfs-batch"])
def test_each_storage_fault_is_seen_once_per_attempt_of_ours(
    lfs_hub, tmp_path, endpoint, fault
) -> None:
    sleeps: list[float] = []
    hub = _store(lfs_hub, tmp_path, sleeps)
    _upload(hub)
    if endpoint != "storage-download":
        lfs_hub.lfs.objects.clear()  # so that the next upload sends its bytes again
    lfs_hub.set_faults(**{fault: 1.0}, endpoints=endpoint)
    before = _counts(lfs_hub).get(f"fault:{fault.split('_')[0]}", 0)
    started = time.monotonic()
    with pytest.raises(HubUnavailable, match="after 3 attempts"):
        (_download if endpoint == "storage-download" else _upload)(hub)
    injected = _counts(lfs_hub)[f"fault:{fault.split('_')[0]}"] - before
    assert injected == 3, injected  # one per attempt of ours: the SDK retried none
    assert len(sleeps) == 2 and time.monotonic() - started < 4.0
    lfs_hub.set_faults(**{fault: 0.0})
    _upload(hub)
    _download(hub)


def test_429_on_storage_honours_retry_after(lfs_hub, tmp_path) -> None:
    sleeps: list[float] = []
    hub = _store(lfs_hub, tmp_path, sleeps, attempts=2)
    lfs_hub.set_faults(rate_limit_rate=1.0, retry_after=5, endpoints="storage")
    started = time.monotonic()
    with pytest.raises(HubUnavailable):
        _upload(hub)
    assert sleeps == [5.0] and time.monotonic() - started < 3.0


def test_truncated_storage_downloads_never_yield_partial_files(lfs_hub, tmp_path) -> None:
    hub = _store(lfs_hub, tmp_path, attempts=12)
    _upload(hub)
    lfs_hub.set_faults(truncate_rate=0.5, endpoints="storage", seed=11)
    for _ in range(6):
        _download(hub)
    assert _counts(lfs_hub)["fault:truncate"] > 0


def test_slow_storage_is_bounded_by_the_request_timeout(lfs_hub, tmp_path) -> None:
    hub = _store(lfs_hub, tmp_path, attempts=1, timeout=1.0)
    _upload(hub)
    lfs_hub.set_faults(slow_rate=1.0, slow_seconds=2.5, endpoints="storage-download")
    started = time.monotonic()
    with pytest.raises(HubUnavailable, match=r"timed out|timeout"):
        _download(hub)
    assert time.monotonic() - started < 2.0


def test_a_delta_and_a_global_above_the_threshold_through_faulty_storage(tmp_path) -> None:
    """End to end through the Hub store: three nodes' deltas and every global take the LFS
    path while storage and LFS requests fail in every way; each contribution is aggregated
    exactly once and the global is the exact mean of the deltas."""
    faults = FaultConfig(
        error_rate=0.1,
        drop_rate=0.08,
        rate_limit_rate=0.08,
        retry_after=0.05,
        slow_rate=0.05,
        slow_seconds=0.2,
        truncate_rate=0.15,
        endpoints="storage,lfs",
        seed=2204,
    )
    emulator = HubEmulator(0, token=TEST_TOKEN, faults=faults, lfs=LfsConfig(threshold=THRESHOLD))
    emulator.start()
    try:
        retry = RetryPolicy(initial=0.01, maximum=0.1, attempts=20, timeout=5.0)
        hub = HubClient(
            "org/e2e", token=TEST_TOKEN, endpoint=emulator.url, cache_dir=tmp_path, retry=retry
        )
        events: list = []
        width = 2048  # 8 KiB of float32 per tensor: above the threshold
        master = RoundMaster(
            hub,
            {"w": torch.zeros(width)},
            settings=RoundSettings.of(
                DistributedConfig(outer_lr=1.0, outer_momentum=0.0, round_timeout=60.0)
            ),
            state_dir=tmp_path / "state",
            emit=lambda e, **fields: events.append((e, fields)),
        )
        through_lfs: list[str] = []  # paths committed as LFS pointers, at each commit

        def landed(repo_id: str, files: dict) -> None:
            through_lfs.extend(p for p in files if p in emulator.repos[repo_id].lfs)

        emulator.on_commit = landed
        hub.create_repo()
        master.reconcile()
        upload_then_poll(hub, master, events, rounds=3, width=width, pause=0.02)
        stats = emulator.stats()
        deltas = {f"nodes/{n}/delta_{r}.safetensors" for n in "abc" for r in range(3)}
        assert deltas <= set(through_lfs), sorted(through_lfs)
        assert through_lfs.count("global/latest.safetensors") >= 4  # initial + 3 rounds
        counts = stats["counts"]
        for kind in ("drop", "error", "rate_limit", "slow", "truncate"):
            assert counts.get(f"fault:{kind}", 0) > 0, (kind, counts)
        rounds = [fields for e, fields in events if e == "outer_step"]
        included = [i for fields in rounds for i in fields["included"]]
        assert len(included) == 9 == len(set(included)), included
        expected = -sum(float(v) for v in range(1, 10)) / 3  # three rounds of node means
        emulator.set_faults(error_rate=0, drop_rate=0, rate_limit_rate=0, truncate_rate=0)
        assert torch.equal(hub.read_global()["w"], torch.full((width,), expected))
    finally:
        emulator.stop()
