"""``speedtronic prepare`` on Parquet against the same text as JSONL, in one run.

Documents: the paragraphs (blank-line separated) of the running Python's standard-library
sources (see ``bench/prepare.py``), written twice with the same rows: as one JSONL file
(``{"text": ...}`` per line) and as one Parquet file (a ``text`` and an ``id`` column, zstd,
row groups of ``--row-group`` rows, as Hub dataset shards are written). Both are prepared with
the same byte-level BPE tokenizer, one worker, one tokenizer thread, each run in a fresh
process (``--repeats`` rounds, order rotated, median wall time, peak RSS from ``wait4``):

* **throughput**: tokens/s of Parquet over tokens/s of JSONL on ``--mb`` MB of text
  (target >= 0.9; both must give the same tokens);
* **memory**: peak RSS of Parquet input of ``--small-mb`` and ``--big-mb`` MB of text (the
  same rows repeated), whose ratio should stay near 1 (target: flat from 10 MB to 500 MB);
  tokenized byte by byte (``bytes``), so the run is about the reader, not the BPE's speed.

    python bench/prepare_parquet.py                     # writes bench/results/prepare_parquet.json
    python bench/prepare_parquet.py --big-mb 100        # a quicker memory check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare import interleaved, stdlib_sources, train_tokenizer

PREPARE = r"""
import json, sys, time
from speedtronic.data.prepare import prepare
source, tokenizer, out = sys.argv[1:4]
start = time.perf_counter()
result = prepare([source], out, tokenizer=tokenizer, workers=1)
tokens = sum(result.meta["tokens"].values())
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="text for the throughput pair")
    parser.add_argument("--small-mb", type=float, default=10.0)
    parser.add_argument("--big-mb", type=float, default=500.0)
    parser.add_argument("--row-group", type=int, default=20_000, help="rows per row group")
    parser.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--out", default="bench/results/prepare_parquet.json")
    return parser.parse_args(argv)


def paragraphs(limit_bytes: int) -> list[str]:
    """Blank-line separated paragraphs of standard-library sources, about ``limit_bytes``."""
    docs: list[str] = []
    for path in stdlib_sources(limit_bytes):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs += [p for p in text.split("\n\n") if p.strip()]
    return docs


def write_pair(docs: list[str], folder: Path, row_group: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    jsonl = folder / "docs.jsonl"
    with open(jsonl, "w", encoding="utf-8") as handle:
        for text in docs:
            handle.write(json.dumps({"text": text}) + "\n")
    parquet = folder / "docs.parquet"
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, parquet, row_group_size=row_group, compression="zstd")
    return jsonl, parquet


def write_repeated(docs: list[str], path: Path, target_bytes: int, row_group: int) -> int:
    """A Parquet file of ``docs`` repeated until about ``target_bytes`` of text, written one
    row group at a time (this script's own memory stays small too); returns the text bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    written, index = 0, 0
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        while written < target_bytes:
            rows = [docs[(index + i) % len(docs)] for i in range(row_group)]
            ids = list(range(index, index + row_group))
            writer.write_table(pa.table({"id": ids, "text": rows}, schema=schema))
            written += sum(len(r.encode("utf-8")) for r in rows)
            index += row_group
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-parquet-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        docs = paragraphs(int(args.mb * 1e6))
        jsonl, parquet = write_pair(docs, work / "pair", args.row_group)
        (work / "text").mkdir()
        (work / "text" / "docs.txt").write_text("\n\n".join(docs), encoding="utf-8")
        tokenizer = train_tokenizer(work / "text", args.vocab, work / "tokenizer.json")
        small, big = work / "small.parquet", work / "big.parquet"
        sizes = {
            "small": write_repeated(docs, small, int(args.small_mb * 1e6), args.row_group),
            "big": write_repeated(docs, big, int(args.big_mb * 1e6), args.row_group),
        }

        def job(name: str, source: Path, spec: str = str(tokenizer)):
            return lambda i: [str(source), spec, str(work / f"{name}-{i}")]

        load_before = os.getloadavg()
        timed = interleaved(
            {
                "jsonl": (PREPARE, job("jsonl", jsonl), 1),
                "parquet": (PREPARE, job("pq", parquet), 1),
            },
            args.repeats,
        )
        memory = interleaved(
            {
                "small": (PREPARE, job("small", small, "bytes"), 1),
                "big": (PREPARE, job("big", big, "bytes"), 1),
            },
            1,
        )
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if timed["jsonl"]["tokens"] != timed["parquet"]["tokens"]:
        raise SystemExit("Parquet and JSONL gave different token counts")
    rate = {name: r["tokens"] / r["seconds"] for name, r in timed.items()}
    result = {
        "documents": len(docs),
        "text_bytes": sum(len(d.encode("utf-8")) for d in docs),
        "tokens_per_s": rate,
        "throughput_ratio_parquet_over_jsonl": rate["parquet"] / rate["jsonl"],
        "memory_text_bytes": sizes,
        "peak_rss_mib": {name: r["peak_rss_mib"] for name, r in memory.items()},
        "peak_rss_ratio_big_over_small": memory["big"]["peak_rss_mib"]
        / memory["small"]["peak_rss_mib"],
        "big_tokens_per_s": memory["big"]["tokens"] / memory["big"]["seconds"],
        "load_average": {"before": load_before, "after": load_after},
        "timed": timed,
        "python": platform.python_version(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"parquet / jsonl tokens/s: {result['throughput_ratio_parquet_over_jsonl']:.3f} "
        f"({rate['parquet']:,.0f} vs {rate['jsonl']:,.0f}; target >= 0.9)\n"
        f"peak RSS, parquet {sizes['small'] / 1e6:.0f} MB vs {sizes['big'] / 1e6:.0f} MB of "
        f"text: {result['peak_rss_mib']['small']:.0f} MiB vs "
        f"{result['peak_rss_mib']['big']:.0f} MiB "
        f"(ratio {result['peak_rss_ratio_big_over_small']:.2f}; target: flat)\n"
        f"wrote {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
