"""docs/data.md's tokenizer recipe (``train_tokenizer.py``) trains on what ``prepare`` reads:
the text field of JSON Lines records, not the raw lines (issue 29: keys, quotes and other
fields' values became tokens)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from test_data_walkthrough import walkthrough
from tokenizer_fixtures import corpus_text


def test_the_recipe_trains_on_the_text_field_of_jsonl(tmp_path) -> None:
    (recipe,) = [code for _, code, name in walkthrough() if name == "train_tokenizer.py"]
    texts = tmp_path / "my-texts"
    (texts / "nested").mkdir(parents=True)
    records = [
        {"text": line, "source": "zzqqxxkk-archive", "id": i}
        for i, line in enumerate(corpus_text(400, seed=3).splitlines())
    ]
    (texts / "nested" / "records.jsonl").write_text(
        "".join(json.dumps(record) + "\n" for record in records)
    )
    (texts / "plain.txt").write_text(corpus_text(100, seed=4))
    rows = [f"zymurgy brewing notes {i}" for i in range(300)] + [None, ""]  # issue 39, item 19
    pq.write_table(pa.table({"id": list(range(302)), "text": rows}), texts / "rows.parquet")
    (texts / ".hidden.txt").write_text("qqhiddenqq " * 500)  # prepare skips hidden files
    (tmp_path / "train_tokenizer.py").write_text(recipe)
    done = subprocess.run(
        [sys.executable, "train_tokenizer.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    merged = [token for token in vocab if len(token) > 1]
    assert len(merged) > 200  # it learned the sentences
    assert not [t for t in merged if '"' in t or "{" in t or ":" in t]  # no JSON syntax
    assert not [t for t in merged if "zzqq" in t or "archive" in t or "qqhidden" in t]
    assert "Ġquick" in vocab  # a word of the text field
    assert "Ġzymurgy" in vocab or "zymurgy" in vocab  # a word of the Parquet column
    replacement = "".join(chr(c) for c in (0xEF, 0xBF, 0xBD))  # U+FFFD in byte-level letters
    assert not [t for t in vocab if replacement in t]  # the file's bytes were never read
