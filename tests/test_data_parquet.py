"""``speedtronic prepare`` reads the Hub's data formats (issue 32, item 2): Parquet files and
folders (the text column chosen with ``--field``, read one record batch at a time) and Hub
datasets by id (``hf://datasets/owner/name``), with the determinism and holdout rules of JSONL.
The Hub is the project's emulator on 127.0.0.1; nothing is downloaded from elsewhere."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_emulator_fixtures import TEST_TOKEN
from tokenizer_fixtures import train_bpe

from speedtronic.cli import main
from speedtronic.data.prepare import prepare
from speedtronic.data.units import collect_sources, iter_units
from speedtronic.testing.hub_server import FaultConfig, HubEmulator, LfsConfig

SMALL = {"shard_tokens": 3000, "unit_bytes": 2048}


def documents(count: int, seed: int = 0) -> list[str]:
    """Documents of varied length, with newlines, non-ASCII text and an empty one."""
    rng = np.random.default_rng(seed)
    words = ["the", "model", "learns", "données", "tokens", "über", "rounds", "a", "of"]
    docs = []
    for i in range(count):
        n = int(rng.integers(0, 60))
        lines = [" ".join(rng.choice(words, size=n)) for _ in range(int(rng.integers(1, 4)))]
        docs.append("" if i == 7 else f"doc {i}: " + "\n".join(lines))
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for i, text in enumerate(docs):
            handle.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def write_parquet(path: Path, docs: list[str | None], rows_per_group: int = 37) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


def stream(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    parts = [np.fromfile(folder / e["file"], dtype=meta["dtype"]) for e in meta["shards"][split]]
    return np.concatenate(parts) if parts else np.empty(0)


def digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.bin"))
    }


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=320)


@pytest.mark.parametrize("workers", [1, 2])
def test_parquet_gives_the_tokens_of_the_same_text_as_jsonl(tmp_path, bpe, workers):
    docs = documents(400)
    write_jsonl(tmp_path / "jsonl" / "a.jsonl", docs[:250])
    write_jsonl(tmp_path / "jsonl" / "b.jsonl", docs[250:])
    write_parquet(tmp_path / "parquet" / "a.parquet", docs[:250])
    write_parquet(tmp_path / "parquet" / "b.parquet", docs[250:], rows_per_group=11)
    options = dict(tokenizer=str(bpe), holdout=0.1, workers=workers, **SMALL)
    from_jsonl = prepare([str(tmp_path / "jsonl")], tmp_path / "out_jsonl", **options)
    from_parquet = prepare([str(tmp_path / "parquet")], tmp_path / "out_parquet", **options)
    assert (
        from_parquet.meta["documents"]
        == from_jsonl.meta["documents"]
        == {
            "train": 360,  # 399 documents: the empty one is none
            "eval": 39,
        }
    )
    assert from_parquet.meta["tokens"] == from_jsonl.meta["tokens"]
    for split in ("train", "eval"):
        assert np.array_equal(
            stream(tmp_path / "out_parquet", split), stream(tmp_path / "out_jsonl", split)
        )
    assert [s["kind"] for s in from_parquet.meta["sources"]] == ["parquet", "parquet"]
    assert [s["documents"] for s in from_parquet.meta["sources"]] == [249, 150]


def test_a_chosen_column_nulls_skipped_and_units_bounded(tmp_path):
    docs: list[str | None] = documents(300)
    docs[3] = None
    table = pa.table({"body": docs, "text": ["decoy"] * len(docs)})
    path = tmp_path / "c.parquet"
    pq.write_table(table, path, row_group_size=50)
    sources, _ = collect_sources([str(path)])
    units = list(iter_units(sources, 1024, "body"))
    longest = max(len(d.encode()) for d in docs if d)
    assert len(units) > 10 and units[-1].last and not any(u.last for u in units[:-1])
    assert all(len(u.data) <= 1024 + longest + 4 for u in units)  # a unit plus one row
    assert sum(u.span for u in units) == path.stat().st_size  # progress adds up to the file
    result = prepare([str(path)], tmp_path / "out", field="body", unit_bytes=1024)
    assert result.meta["documents"]["train"] == 300 - 2  # the null and the empty row
    decoded = bytes(stream(tmp_path / "out", "train").astype(np.uint8)[:20]).decode()
    assert decoded.startswith("doc 0: ")


def test_invalid_utf8_in_a_parquet_column_follows_the_utf8_option(tmp_path, capsys):
    """A Parquet writer need not check UTF-8 (issue 39, item 11: a traceback, exit 1): the
    default replaces and counts, ``--utf8 strict`` is one line naming the file and the row."""
    good = [f"row {i} text" for i in range(2000)]
    raw = [t.encode() for t in good]
    raw[1500] = b"bad \xff\xfe bytes"  # in the second record batch (1,024 rows each)
    raw[1501] = None
    column = pa.array(raw, type=pa.binary()).view(pa.string())  # unchecked, as a writer may
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": column}), path, row_group_size=700)
    out = str(tmp_path / "out")
    assert main(["prepare", "--no-progress", "-i", str(path), "-o", out]) == 0
    err = capsys.readouterr().err
    assert f"{path}: 2 invalid UTF-8 sequences replaced with U+FFFD" in err  # one per byte
    tokens = bytes(stream(Path(out), "train").astype(np.uint8))
    assert "bad \ufffd\ufffd bytes".encode() in tokens and tokens.count(b"row ") == 1998
    code = main(["prepare", "--no-progress", "-i", str(path), "-o", str(tmp_path / "s"),
                 "--utf8", "strict"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"{path}: row 1501, column 'text': invalid UTF-8 (--utf8 strict)" in err
    assert not (tmp_path / "s" / "meta.json").exists()


def test_parquet_is_deterministic_and_an_interrupted_run_resumes(tmp_path, bpe):
    path = write_parquet(tmp_path / "in" / "a.parquet", documents(600, seed=3), rows_per_group=9)
    clean = prepare([str(path)], tmp_path / "clean", tokenizer=str(bpe), holdout=0.05, **SMALL)
    seen = []

    def stop_after_some(nbytes: int, _tokens: int) -> None:
        seen.append(nbytes)
        if len(seen) == 12:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(
            [str(path)],
            tmp_path / "again",
            tokenizer=str(bpe),
            holdout=0.05,
            progress=stop_after_some,
            **SMALL,
        )
    assert not (tmp_path / "again" / "meta.json").exists()
    notes: list[str] = []
    again = prepare(
        [str(path)], tmp_path / "again", tokenizer=str(bpe), holdout=0.05, log=notes.append, **SMALL
    )
    assert again.status == "resumed" and any("resuming" in n for n in notes)
    assert digests(tmp_path / "again") == digests(tmp_path / "clean")
    assert again.meta["tokens"] == clean.meta["tokens"]


def test_bad_parquet_input_is_one_line_exit_2(tmp_path, capsys):
    write_parquet(tmp_path / "a.parquet", ["x"] * 5)
    code = main(["prepare", "--no-progress", "-i", str(tmp_path / "a.parquet"), "-o",
                 str(tmp_path / "o"), "--field", "content"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "no 'content' column (columns: id, text)" in err and "--field" in err
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    code = main(["prepare", "--no-progress", "-i", str(tmp_path / "n.parquet"), "-o",
                 str(tmp_path / "o")])  # fmt: skip
    assert code == 2 and "column 'text' is int64, expected a string" in capsys.readouterr().err
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    code = main(["prepare", "--no-progress", "-i", str(tmp_path / "bad.parquet"), "-o",
                 str(tmp_path / "o")])  # fmt: skip
    assert code == 2 and "not a readable Parquet file" in capsys.readouterr().err
    assert not (tmp_path / "o" / "meta.json").exists()


# ----------------------------------------------------------------------------- Hub datasets
def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", "prepare", "--no-progress", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN=TEST_TOKEN)
    env.update(HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def test_a_hub_dataset_by_id_then_offline_from_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import HfApi, constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the emulator speaks LFS

    docs = documents(500, seed=5)
    local = tmp_path / "local"
    write_parquet(local / "data" / "train-00000.parquet", docs[:300])
    write_parquet(local / "data" / "train-00001.parquet", docs[300:])
    (local / "README.md").write_text("---\nlicense: mit\n---\n# corpus\n")
    (local / "ignored.bin").write_bytes(os.urandom(64))  # not a data file: not fetched
    emulator = HubEmulator(0, token=TEST_TOKEN, faults=FaultConfig(seed=7), lfs=LfsConfig(2048))
    emulator.start()
    try:
        api = HfApi(endpoint=emulator.url, token=TEST_TOKEN)
        api.create_repo("org/corpus", repo_type="dataset")
        api.upload_folder(folder_path=str(local), repo_id="org/corpus", repo_type="dataset")
        stats = emulator.stats()
        env = _env(tmp_path, emulator.url)
        online = _cli(["-i", "hf://datasets/org/corpus", "-o", "from_hub", "--holdout", "0.1"],
                      env, tmp_path)  # fmt: skip
        assert online.returncode == 0, online.stderr
        assert "written from_hub" in online.stdout
        lfs_downloads = emulator.stats()
        missing = _cli(["-i", "hf://datasets/org/nothing", "-o", "x"], env, tmp_path)
        assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
        assert "not found" in missing.stderr and TEST_TOKEN not in missing.stderr
        # An empty segment before an absolute path: snapshot / "/abs" is /abs (issue 39)
        escape = _cli(["-i", f"hf://datasets/org/corpus/{local / 'data'}", "-o", "esc"],
                      env, tmp_path)  # fmt: skip
        assert escape.returncode == 2 and "an empty ('//')" in escape.stderr
        assert not (tmp_path / "esc").exists()
    finally:
        emulator.stop()
    assert stats != lfs_downloads  # the parquet files came through the emulator
    prepare([str(local / "data")], tmp_path / "from_disk", holdout=0.1)
    for split in ("train", "eval"):
        assert np.array_equal(stream(tmp_path / "from_hub", split),
                              stream(tmp_path / "from_disk", split))  # fmt: skip
    fetched = sorted(p.name for p in (tmp_path / "hf-home").rglob("*") if p.is_file())
    assert "ignored.bin" not in fetched and "README.md" not in fetched
    # The emulator is gone: offline, the cache answers; a dataset never fetched is one line.
    offline = _env(tmp_path, emulator.url, HF_HUB_OFFLINE="1")
    again = _cli(["-i", "hf://datasets/org/corpus/data", "-o", "offline", "--holdout", "0.1"],
                 offline, tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert np.array_equal(stream(tmp_path / "offline", "train"),
                          stream(tmp_path / "from_disk", "train"))  # fmt: skip
    never = _cli(["-i", "hf://datasets/org/other", "-o", "y"], offline, tmp_path)
    assert never.returncode == 2 and "HF_HUB_OFFLINE=1" in never.stderr


def test_an_unreachable_hub_fails_fast_with_the_offline_hint(tmp_path):
    import socket
    import time

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    started = time.monotonic()
    result = _cli(["-i", "hf://datasets/org/corpus", "-o", "z"], _env(tmp_path, closed), tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "HF_HUB_OFFLINE=1" in result.stderr
    assert time.monotonic() - started < 20  # retries within ~3.5 s plus interpreter start-up


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("hf://models/org/x", "only Hub datasets"),
        ("hf://datasets/org", "expected hf://datasets/<owner>/<name>"),
        ("hf://datasets/org/x/../y", "'..' is not allowed"),
        ("hf://datasets/org/x//PLANTED", "an empty ('//'), '.'"),  # folder / "/abs" is /abs
        ("hf://datasets/org/x/./data", "an empty ('//'), '.'"),
    ],
)
def test_malformed_hub_references_are_refused(tmp_path, capsys, spec, needle):
    """Refused before any request, so nothing outside the snapshot is read (issue 39, item 10:
    ``//abs/path`` used to make ``prepare`` tokenize ``/abs/path`` from the local disk)."""
    planted = tmp_path / "planted"
    (planted / "secret.txt").parent.mkdir()
    (planted / "secret.txt").write_text("a local file that is no part of the dataset\n")
    spec = spec.replace("PLANTED", str(planted).lstrip("/"))
    code = main(["prepare", "--no-progress", "-i", spec, "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_fetch_refuses_a_path_that_leaves_the_snapshot_before_any_request():
    from speedtronic.hub_files import DATA_PATTERNS, HubFilesError, HubRef, fetch

    for path in ("/etc", "data//x", "../up", "./data"):
        with pytest.raises(HubFilesError, match="not allowed in the path"):
            fetch(HubRef("org/x", "dataset", None, path), DATA_PATTERNS)


def test_without_pyarrow_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    write_parquet(tmp_path / "a.parquet", ["some text"] * 3)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    code = main(["prepare", "--no-progress", "-i", str(tmp_path), "-o", str(tmp_path / "o")])
    assert code == 2
    assert "pip install 'speedtronic[parquet]'" in capsys.readouterr().err


def test_reading_parquet_holds_one_row_group_not_the_file(tmp_path):
    """Memory while reading is bounded by a row group, whatever the file size (pyarrow's
    pre-buffering kept every row group read so far: 25 MiB for this file)."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    rows = [bytes(rng.choice(letters, size=500)).decode() for _ in range(500)]
    schema = pa.schema([("text", pa.string())])
    path = tmp_path / "big.parquet"
    with pq.ParquetWriter(path, schema) as writer:
        for _ in range(100):  # 100 row groups of 250 KB of text: 25 MB
            writer.write_table(pa.table({"text": rows}, schema=schema))
    sources, _ = collect_sources([str(path)])
    peak = start = pa.total_allocated_bytes()
    count = 0
    for unit in iter_units(sources, 1 << 20, "text"):
        peak = max(peak, pa.total_allocated_bytes())
        count += len(unit.data)
    assert count > 25_000_000
    assert peak - start < 4 * 2**20, f"{(peak - start) / 2**20:.1f} MiB held by pyarrow"
