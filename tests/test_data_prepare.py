"""``speedtronic prepare``: shards + meta.json, workers give the same bytes, resume, bad input."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizer_fixtures import corpus_text, train_bpe, word_level, write_corpus

from speedtronic.cli import main
from speedtronic.data.prepare import PrepareError, prepare
from speedtronic.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SMALL = {"shard_tokens": 3000, "unit_bytes": 2048}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=320)


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus", files=10, lines=40)


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*"))}


def stream(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    parts = [np.fromfile(folder / e["file"], dtype=meta["dtype"]) for e in meta["shards"][split]]
    return np.concatenate(parts) if parts else np.empty(0)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["prepare", "--no-progress", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_shards_meta_and_documents_separated_by_eos(tmp_path, corpus, bpe):
    result = prepare([str(corpus)], tmp_path / "out", tokenizer=str(bpe), holdout=0.2, **SMALL)
    meta = result.meta
    tokenizer = load_tokenizer(str(bpe))
    assert result.status == "written" and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == {
        "spec": str(bpe),
        "file": str(bpe.resolve()),
        "sha256": hashlib.sha256(bpe.read_bytes()).hexdigest(),
        "encoding": tokenizer.encoding,  # what it encodes (issue 39: an export's copy matches)
        "vocab_size": 320,
        "eos_id": tokenizer.eos_id,
        "eos_token": "<|endoftext|>",
    }
    files = sorted(corpus.iterdir())
    # documents 4 and 9 (0-based) are held out: floor((i+1)*0.2) > floor(i*0.2)
    assert meta["documents"] == {"train": 8, "eval": 2}
    expected = {"train": [], "eval": []}
    for i, path in enumerate(files):
        split = "eval" if i in (4, 9) else "train"
        expected[split] += [*tokenizer.encode(path.read_text()), tokenizer.eos_id]
    for split in ("train", "eval"):
        assert stream(tmp_path / "out", split).tolist() == expected[split]
        shards = meta["shards"][split]
        assert all(e["tokens"] == 3000 for e in shards[:-1]) and 0 < shards[-1]["tokens"] <= 3000
        assert meta["tokens"][split] == len(expected[split])
    assert [s["path"] for s in meta["sources"]] == [str(p) for p in files]
    assert sum(s["tokens"] for s in meta["sources"]) == sum(meta["tokens"].values())
    assert not (tmp_path / "out" / ".partial").exists()


def test_workers_give_the_same_bytes_as_one(tmp_path, corpus, bpe):
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": corpus_text(3, seed=i)}) + "\n" for i in range(60))
    )
    inputs = [str(corpus), str(jsonl)]
    one = prepare(inputs, tmp_path / "one", tokenizer=str(bpe), holdout=0.1, workers=1, **SMALL)
    three = prepare(inputs, tmp_path / "three", tokenizer=str(bpe), holdout=0.1, workers=3, **SMALL)
    assert digests(tmp_path / "one") != {} and len(one.meta["shards"]["train"]) > 3
    strip = {"meta.json"}
    assert {k: v for k, v in digests(tmp_path / "one").items() if k not in strip} == {
        k: v for k, v in digests(tmp_path / "three").items() if k not in strip
    }
    for key in ("documents", "tokens", "shards", "sources", "fingerprint"):
        assert one.meta[key] == three.meta[key]
    assert one.meta["documents"]["train"] + one.meta["documents"]["eval"] == 70


def test_jsonl_field_bytes_tokenizer_and_uint32(tmp_path):
    records = tmp_path / "data.jsonl"
    lines = [json.dumps({"body": f"record {i} é", "id": i}) for i in range(5)]
    records.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
    result = prepare([str(records)], tmp_path / "b", field="body")
    assert result.meta["tokenizer"]["eos_id"] is None and result.meta["dtype"] == "uint16"
    expected = b"".join(f"record {i} é".encode() for i in range(5))
    assert bytes(stream(tmp_path / "b", "train").astype(np.uint8)) == expected
    big = word_level(tmp_path / "big.json", 70_000)
    text = tmp_path / "w.txt"
    text.write_text("w1 w69000 w5\n")
    meta = prepare([str(text)], tmp_path / "u32", tokenizer=str(big)).meta
    assert meta["dtype"] == "uint32"
    assert stream(tmp_path / "u32", "train").tolist() == [1, 69000, 5, 69_999]


def test_non_utf8_is_replaced_and_counted_per_file_or_refused(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "good.txt").write_text("fine text \ufffd\n")  # a real U+FFFD is not counted
    (folder / "latin1.txt").write_bytes(b"caf\xe9 \xef\xbf\xbd cr\xe8me \xff ok\n")
    code, out, err = cli(capsys, "-i", str(folder), "-o", str(tmp_path / "out"))
    assert code == 0 and "written" in out
    assert f"note: {folder / 'latin1.txt'}: 3 invalid UTF-8 sequences replaced" in err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert [s["replaced"] for s in meta["sources"]] == [0, 3]
    code, _, err = cli(capsys, "-i", str(folder), "-o", str(tmp_path / "s"), "--utf8", "strict")
    assert code == 2 and "latin1.txt: invalid UTF-8 at byte 3 (--utf8 strict)" in err
    assert not (tmp_path / "s" / "meta.json").exists()


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("binary", "looks binary (NUL bytes in its first 8 KiB)"),
        ("empty_file", "is empty"),
        ("empty_folder", "holds no non-empty files"),
        ("missing", "input not found"),
        ("bad_json", "data.jsonl:3: not valid JSON"),
        ("no_field", "data.jsonl:2: no 'text' field (fields: body); choose one with --field"),
        ("not_string", "data.jsonl:1: field 'text' is a int, expected a string"),
        ("bad_tokenizer", "--tokenizer"),
        ("only_blank", "hold no text to tokenize"),
        ("holdout_none", "--holdout 0.1 of 1 documents holds out none"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, setup, needle):
    source = tmp_path / "in"
    source.mkdir()
    extra: list[str] = []
    if setup == "binary":
        (source / "a.txt").write_text("text\n")
        (source / "b.png").write_bytes(b"\x89PNG\x00\x00\x01")
    elif setup == "empty_file":
        source = tmp_path / "empty.txt"
        source.write_text("")
    elif setup == "missing":
        source = tmp_path / "nothere"
    elif setup in ("bad_json", "no_field", "not_string", "only_blank"):
        lines = {
            "bad_json": ['{"text": "a"}', '{"text": "b"}', '{"text": "c"'],
            "no_field": ['{"text": "a"}', '{"body": "b"}'],
            "not_string": ['{"text": 3}'],
            "only_blank": ['{"text": ""}', "   "],
        }[setup]
        source = tmp_path / "data.jsonl"
        source.write_text("\n".join(lines) + "\n")
    elif setup == "bad_tokenizer":
        (source / "a.txt").write_text("text\n")
        (tmp_path / "tok.json").write_text("{broken")
        extra = ["--tokenizer", str(tmp_path / "tok.json")]
    elif setup == "holdout_none":
        (source / "a.txt").write_text("one document\n")
        extra = ["--holdout", "0.1"]
    code, _, err = cli(capsys, "-i", str(source), "-o", str(tmp_path / "out"), *extra)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "out" / "meta.json").exists()
    assert not (tmp_path / "out" / ".partial").exists()


def test_another_corpus_is_refused_unless_overwrite_and_kept_if_the_new_one_fails(
    tmp_path, corpus, capsys
):
    out = tmp_path / "out"
    prepare([str(corpus)], out, **SMALL)
    before = digests(out)
    other = tmp_path / "other.txt"
    other.write_text("something else entirely\n")
    code, _, err = cli(capsys, "-i", str(other), "-o", str(out))
    assert code == 2 and "holds a corpus of other inputs or settings" in err
    assert "--overwrite" in err and digests(out) == before
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n' * 500 + "{oops\n")
    code, _, err = cli(capsys, "-i", str(broken), "-o", str(out), "--overwrite")
    assert code == 2 and "broken.jsonl:501: not valid JSON" in err
    assert digests(out) == before  # the old corpus survives a failed replacement
    code, out_text, _ = cli(capsys, "-i", str(other), "-o", str(out), "--overwrite")
    assert code == 0 and "written" in out_text
    assert json.loads((out / "meta.json").read_text())["sources"][0]["path"] == str(other)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train_000000.bin"]


def test_a_foreign_folder_is_refused_and_the_same_corpus_is_left_alone(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.bin").write_bytes(b"\x01\x00" * 10)
    code, _, err = cli(capsys, "-i", str(corpus), "-o", str(out))
    assert code == 2 and "is not empty and is not a prepared folder" in err
    assert (out / "train.bin").read_bytes() == b"\x01\x00" * 10
    fresh = tmp_path / "fresh"
    assert cli(capsys, "-i", str(corpus), "-o", str(fresh))[0] == 0
    before = digests(fresh)
    code, out_text, err = cli(capsys, "-i", str(corpus), "-o", str(fresh))
    assert code == 0 and out_text.startswith("unchanged") and "nothing to do" in err
    assert digests(fresh) == before


def test_an_interrupted_run_looks_incomplete_and_resumes_to_the_same_bytes(tmp_path, corpus, bpe):
    options = dict(tokenizer=str(bpe), holdout=0.25, **SMALL)
    reference = prepare([str(corpus)], tmp_path / "ref", **options)
    calls = []

    def interrupt(nbytes: int, ntokens: int) -> None:
        calls.append(nbytes)
        if len(calls) == 7:
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], out, progress=interrupt, **options)
    assert not (out / "meta.json").exists()
    assert [p.name for p in out.iterdir()] == [".partial"]  # nothing that looks complete
    notes: list[str] = []
    resumed = prepare([str(corpus)], out, log=notes.append, workers=2, **options)
    assert resumed.status == "resumed"
    assert any(n.startswith("resuming the interrupted run") for n in notes), notes
    assert digests(out).keys() == digests(tmp_path / "ref").keys()
    assert {k: v for k, v in digests(out).items() if k != "meta.json"} == {
        k: v for k, v in digests(tmp_path / "ref").items() if k != "meta.json"
    }
    assert resumed.meta["fingerprint"] == reference.meta["fingerprint"]


def test_a_partial_run_of_other_inputs_starts_clean_and_says_so(tmp_path, corpus):
    out = tmp_path / "out"

    def interrupt(nbytes: int, ntokens: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], out, progress=interrupt, **SMALL)
    (corpus / "doc_000.txt").write_text("changed\n")
    notes: list[str] = []
    result = prepare([str(corpus)], out, log=notes.append, **SMALL)
    assert result.status == "written"
    assert any("starting clean" in n and "other inputs" in n for n in notes), notes


def test_sigkill_mid_run_then_rerun_resumes(tmp_path, bpe):
    corpus = write_corpus(tmp_path / "big", files=40, lines=1500)
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "speedtronic", "prepare", "--no-progress", "-i", str(corpus),
        "-o", str(out), "--tokenizer", str(bpe), "--shard-tokens", "20000",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    progress = out / ".partial" / "progress.json"
    shard = out / ".partial" / "train_000001.bin"
    while not shard.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert progress.exists() and not (out / "meta.json").exists()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resuming the interrupted run" in done.stderr and done.stdout.startswith("resumed")
    clean = subprocess.run(
        [*command[:-6], "-o", str(tmp_path / "clean"), *command[-4:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert clean.returncode == 0, clean.stderr
    ours = {k: v for k, v in digests(out).items() if k != "meta.json"}
    assert ours == {k: v for k, v in digests(tmp_path / "clean").items() if k != "meta.json"}


def test_bad_options_are_refused(tmp_path, corpus, capsys):
    assert "--holdout must be" in cli(capsys, "-i", str(corpus), "-o", "x", "--holdout", "1")[2]
    assert "--holdout must be" in cli(capsys, "-i", str(corpus), "-o", "x", "--holdout", "a")[2]
    assert "must be positive" in cli(capsys, "-i", str(corpus), "-o", "x", "--workers", "0")[2]
    file = tmp_path / "file"
    file.write_text("x")
    assert "is a file, expected a folder" in cli(capsys, "-i", str(corpus), "-o", str(file))[2]
    with pytest.raises(PrepareError, match="--utf8"):
        prepare([str(corpus)], tmp_path / "y", utf8="latin1")


def test_units_are_bounded_and_cover_every_byte(tmp_path):
    from speedtronic.data.units import Source, iter_units

    text = tmp_path / "a.txt"
    body = corpus_text(400).encode() + ("é" * 3000).encode() + b"  tail\n\n  end"
    text.write_bytes(body)
    jsonl = tmp_path / "b.jsonl"
    long_line = json.dumps({"text": "x" * 9000})
    jsonl.write_text(f'{{"text": "a"}}\n{long_line}\n{{"text": "b"}}\n')
    sources = [
        Source(str(p), k, p.stat().st_size, 0) for p, k in ((text, "text"), (jsonl, "jsonl"))
    ]
    units = list(iter_units(sources, 1024))
    for number, path in enumerate((text, jsonl)):
        mine = [u for u in units if u.source == number]
        assert b"".join(u.data for u in mine) == path.read_bytes()
        assert [u.last for u in mine] == [False] * (len(mine) - 1) + [True]
        assert [u.offset for u in mine] == [
            sum(len(v.data) for v in mine[:i]) for i in range(len(mine))
        ]
        for unit in mine:
            unit.data.decode("utf-8")  # never a character cut in two
    text_units = [u for u in units if u.source == 0]
    assert len(text_units) > 20 and max(len(u.data) for u in text_units) <= 1024
    # cut before the whitespace run around a newline: no word or run of blanks is split
    for before, after in itertools.pairwise(text_units):
        forced = not any(c in before.data[1:] for c in b" \n")  # no blank: a character cut
        assert forced or (after.data[:1].isspace() and not before.data[-1:].isspace())
    json_units = [u for u in units if u.source == 1]
    assert all(u.data.endswith(b"\n") for u in json_units)  # whole lines, one longer than a unit
    raw = jsonl.read_bytes()
    assert [u.first_line for u in json_units] == [
        1 + raw[: u.offset].count(b"\n") for u in json_units
    ]
    assert len(json_units) >= 2 and json_units[1].first_line == 2
    assert [u.index for u in units] == list(range(len(units)))
