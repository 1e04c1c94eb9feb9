"""huggingface_hub through public names only, and no Xet for the Hub store (issue 22, items 2
and 3; issue 30): no private import of the SDK (or of httpx2) anywhere in the package, a
version bound that the installed SDK satisfies, the session installed through
``set_client_factory`` shaping only the requests of a HubClient call (the SDK is unchanged for
every other user of the process, Xet and proxies included), several staged files of one commit
bounded too, and the store's large files on the LFS path."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import tomllib
from hub_emulator_fixtures import TEST_TOKEN

from speedtronic.diloco import hub as hub_http
from speedtronic.diloco.hub import HubClient
from speedtronic.retry import HubUnavailable, RetryPolicy
from speedtronic.testing.hub_server import FaultConfig, HubEmulator, LfsConfig

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ("huggingface_hub", "httpx2", "httpx", "hf_xet")
#: httpx client internals the old hub_http rewired (client._transport, client._mounts).
CLIENT_INTERNALS = frozenset({"_transport", "_mounts", "_transport_for_url", "_pool"})


def private_uses(source: str) -> list[str]:
    """Imports of, and attribute reads through, a private name of a watched package (one
    finding per line)."""
    found: dict[int, str] = {}
    aliases: dict[str, str] = {}  # local name -> dotted module it stands for

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] in WATCHED and any(p.startswith("_") for p in parts[1:])

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[(alias.asname or alias.name).split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
                if private(alias.name):
                    found[node.lineno] = f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = dotted
                if private(dotted):
                    found[node.lineno] = f"from {node.module} import {alias.name}"
    uses_httpx = any(module.split(".")[0] in ("httpx", "httpx2") for module in aliases.values())
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and uses_httpx and node.attr in CLIENT_INTERNALS:
            found.setdefault(node.lineno, f"httpx client internals: .{node.attr}")
        if isinstance(node, ast.Attribute):
            chain, current = [node.attr], node.value
            while isinstance(current, ast.Attribute):
                chain.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id in aliases:
                dotted = ".".join([aliases[current.id], *reversed(chain)])
                if private(dotted) and len(dotted) > len(found.get(node.lineno, "")):
                    found[node.lineno] = dotted
    return [f"line {line}: {text}" for line, text in sorted(found.items())]


def test_the_scan_finds_every_form_of_private_use() -> None:
    bad = """
from huggingface_hub.utils import _http
from huggingface_hub.utils._http import get_session
import huggingface_hub.utils._xet
from huggingface_hub import _commit_api as api
import httpx2
import huggingface_hub as hh
client = httpx2.Client()
t = httpx2._transports.default.HTTPTransport
hh.utils._http.set_client_factory(None)
client._transport = client._mounts
"""
    found = private_uses(bad)
    assert len(found) == 7, found
    good = (
        "from huggingface_hub import set_client_factory, constants\n"
        "import httpx2\nhttpx2.HTTPTransport()\nconstants.HF_HUB_DISABLE_XET = True\n"
    )
    assert private_uses(good) == []


def test_no_private_huggingface_hub_or_httpx_use_in_the_package() -> None:
    offenders = {
        str(path.relative_to(ROOT)): uses
        for path in sorted((ROOT / "speedtronic").rglob("*.py"))
        if (uses := private_uses(path.read_text()))
    }
    assert offenders == {}


def test_the_sdk_version_is_bounded_and_the_installed_one_fits() -> None:
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = canonicalize_name("huggingface_hub")
    (hub,) = [Requirement(d) for d in deps if canonicalize_name(Requirement(d).name) == wanted]
    uppers = [s for s in hub.specifier if s.operator in ("<", "<=", "~=", "==")]
    assert uppers, f"no upper bound on huggingface_hub: {hub}"
    assert hub.specifier.contains(version("huggingface_hub")), (hub, version("huggingface_hub"))


def test_only_requests_of_a_hubclient_call_are_shaped(tmp_path) -> None:
    """The SDK's shared client is the HubSession once a HubClient has run; a request outside
    a HubClient call is answered as the SDK's default client answers it (a 503 is a response
    for the SDK to retry), one inside a call is our error, which the SDK does not retry."""
    import huggingface_hub

    emulator = HubEmulator(0, token=TEST_TOKEN).start()
    try:
        hub = HubClient("org/shaped", token=TEST_TOKEN, endpoint=emulator.url, cache_dir=tmp_path)
        hub.create_repo()
        session = huggingface_hub.get_session()
        assert isinstance(session, hub_http.HubSession)
        hub_http.install_session()  # installed once: the same session stays
        assert huggingface_hub.get_session() is session
        emulator.set_faults(error_rate=1.0, endpoints="tree")
        url = f"{emulator.url}/api/models/org/shaped/tree/main"
        assert session.get(url).status_code >= 500
        with hub_http.hub_call(5.0), pytest.raises(hub_http.HubHTTPStatus):
            session.get(url)
    finally:
        emulator.stop()


@pytest.fixture
def lfs_hub():
    emulator = HubEmulator(
        0, token=TEST_TOKEN, faults=FaultConfig(seed=5), lfs=LfsConfig(threshold=1024)
    )
    emulator.lfs.config.advertise_xet = True  # resolve answers as a Xet-backed repository
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


def _hub(emulator, tmp_path, **policy) -> HubClient:
    settings = {"initial": 0.01, "maximum": 0.02, "attempts": 2, "timeout": 5.0, **policy}
    retry = RetryPolicy(**settings, sleeper=lambda s: None)
    hub = HubClient(
        "org/xet", token=TEST_TOKEN, endpoint=emulator.url, cache_dir=tmp_path, retry=retry
    )
    hub.create_repo()
    return hub


def test_our_large_files_take_the_lfs_path_while_the_sdk_keeps_xet(
    lfs_hub, tmp_path, monkeypatch
) -> None:
    """The store's files never go through Xet (which would move them past our client), and
    the SDK's Xet setting stays as it was: the same file fetched by another user of the SDK in
    this process goes to the Xet routes (the emulator has no Xet service: an error)."""
    from huggingface_hub import HfApi, constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)  # the SDK's default
    hub = _hub(lfs_hub, tmp_path)
    hub.commit({"big.bin": b"x" * 4096})
    assert hub.read_bytes("big.bin") == b"x" * 4096
    counts = lfs_hub.stats()["counts"]
    assert counts["PUT storage-upload"] == 1 and counts["GET storage-download"] == 1
    assert counts["POST lfs-batch"] == 1
    assert not [k for k in counts if k.endswith(" xet")], counts
    assert constants.HF_HUB_DISABLE_XET is False
    api = HfApi(endpoint=lfs_hub.url, token=TEST_TOKEN)
    with pytest.raises(Exception):  # noqa: B017
        api.hf_hub_download("org/xet", "big.bin", local_dir=tmp_path / "dl")
    counts = lfs_hub.stats()["counts"]
    assert counts.get("GET xet", 0) + counts.get("POST xet", 0) >= 1, counts


def test_with_hf_xet_installed_our_uploads_still_take_the_lfs_path(
    lfs_hub, tmp_path, monkeypatch, caplog
) -> None:
    """Where hf_xet is installed the SDK uploads through it unless handed open files: the
    store hands it open files (staged or in memory), silently, and the LFS path is taken."""
    import huggingface_hub._commit_api as commit_api  # the SDK's own switch, simulated

    monkeypatch.setattr(commit_api, "is_xet_available", lambda: True)
    hub = _hub(lfs_hub, tmp_path)
    staged = tmp_path / "staged.bin"
    staged.write_bytes(b"s" * 4096)
    with caplog.at_level("DEBUG", logger="huggingface_hub"):
        hub.commit({"big.bin": b"x" * 4096, "staged.bin": staged})
    counts = lfs_hub.stats()["counts"]
    assert counts["PUT storage-upload"] == 2, counts
    assert not [k for k in counts if k.endswith(" xet")], counts
    assert not [r for r in caplog.records if "Xet" in r.getMessage()]


def test_several_staged_files_of_one_commit_are_each_bounded(tmp_path) -> None:
    """The SDK uploads several LFS files of one call from worker threads, which the call's
    deadline does not reach: the store uploads each staged file in a call of its own, so each
    upload still times out after request_timeout."""
    emulator = HubEmulator(0, token=TEST_TOKEN, lfs=LfsConfig(threshold=1024)).start()
    try:
        hub = _hub(emulator, tmp_path, attempts=1, timeout=1.0)
        emulator.set_faults(slow_rate=1.0, slow_seconds=3.0, endpoints="storage-upload")
        staged = {}
        for name in ("a.bin", "b.bin"):
            staged[name] = tmp_path / f"staged-{name}"
            staged[name].write_bytes(name.encode() * 1024)
        started = time.monotonic()
        with pytest.raises(HubUnavailable):
            hub.commit(staged)
        assert time.monotonic() - started < 2.5
    finally:
        emulator.stop()


def test_proxies_from_the_environment_are_used_and_no_proxy_goes_direct(
    monkeypatch,
) -> None:
    """The session reads the proxies as the SDK's default client does (httpx, from the
    environment); a failure through one is our error inside a HubClient call only."""
    import httpx2

    emulator = HubEmulator(0).start()
    try:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
            for key in (name, name.lower()):
                monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
        url = f"{emulator.url}/api/whoami-v2"
        with pytest.raises(httpx2.ConnectError):  # the proxy is used ...
            hub_http.HubSession().get(url)
        with hub_http.hub_call(5.0), pytest.raises(hub_http.HubConnectionError):  # ... ours
            hub_http.HubSession().get(url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert hub_http.HubSession().get(url).status_code == 200
    finally:
        emulator.stop()
