"""``speedtronic prepare`` against a plain ``tokenizers`` ``encode_batch`` loop, in one run.

Corpus: the running Python's standard-library sources (``*.py`` outside site-packages and
tests, sorted, the first ``--mb`` megabytes), tokenized with a byte-level BPE tokenizer
(``--vocab``) trained here on the same text. Every measurement runs in a fresh process
(``--repeats`` rounds, the order rotated each round, median wall time of the work itself,
peak RSS and CPU time from ``wait4``; the load average is recorded, since a busy machine skews
wall-time ratios, and CPU-time ratios are printed beside them):

* **peer**: read each file, ``Tokenizer.encode_batch`` 64 files at a time, append the ids
  as uint16 to one ``.bin`` file: the plain loop a user would write (and the same loop with
  ``encode_batch_fast``, which ``prepare`` uses: no offsets are computed);
* **prepare, 1 worker**: ``speedtronic.data.prepare.prepare`` (shards, meta.json, resume
  records, EOS, holdout bookkeeping).

Both of that pair get one tokenizer thread (``RAYON_RS_NUM_CPUS=1``), so the ratio compares
the pipelines, not thread counts. Then ``prepare`` with 2 workers (one thread each) gives the
speed-up on this machine's cores, and ``prepare`` on a corpus 10x larger (the same files
hard-linked ten times) compares peak memory with the 1x run.

    python bench/prepare.py                  # ~4 MB corpus, writes bench/results/prepare.json

Targets (issue 16): throughput ratio >= 0.9 with one worker; peak RSS at 10x within 1.2x of 1x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PEER = r"""
import json, os, sys, time
import numpy as np
from tokenizers import Tokenizer
corpus, tokenizer_path, out, method = sys.argv[1:5]
tokenizer = Tokenizer.from_file(tokenizer_path)
encode = getattr(tokenizer, method)
files = sorted(os.path.join(r, f) for r, _, fs in os.walk(corpus) for f in fs)
start = time.perf_counter()
tokens = 0
with open(out, "wb") as sink:
    for i in range(0, len(files), 64):
        texts = [open(f, encoding="utf-8", errors="replace").read() for f in files[i : i + 64]]
        for encoding in encode(texts):
            ids = np.asarray(encoding.ids, dtype=np.uint16)
            ids.tofile(sink)
            tokens += ids.size
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""

PREPARE = r"""
import json, sys, time
from speedtronic.data.prepare import prepare
corpus, tokenizer_path, out, workers = sys.argv[1:5]
start = time.perf_counter()
result = prepare([corpus], out, tokenizer=tokenizer_path, workers=int(workers))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tokens": sum(result.meta["tokens"].values())}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="1x corpus size in megabytes")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--out", default="bench/results/prepare.json")
    return parser.parse_args(argv)


def stdlib_sources(limit_bytes: int) -> list[Path]:
    """The first ``limit_bytes`` of standard-library ``*.py`` files, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "test", "tests", "idle_test"} or not path.is_file():
            continue
        chosen.append(path)
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return chosen


def build_corpora(work: Path, files: list[Path]) -> tuple[Path, Path]:
    """``work/x1`` (copies) and ``work/x10`` (ten hard-linked copies of x1)."""
    one, ten = work / "x1", work / "x10"
    for index, path in enumerate(files):
        target = one / f"{index:05d}_{path.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    for copy in range(10):
        folder = ten / f"copy{copy}"
        folder.mkdir(parents=True)
        for path in sorted(one.iterdir()):
            os.link(path, folder / path.name)
    return one, ten


def train_tokenizer(corpus: Path, vocab: int, path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    tokenizer.save(str(path))
    return path


def measure(script: str, args: list[str], threads: int | None) -> dict:
    """Run ``script`` in a fresh interpreter: its JSON line plus the peak RSS (MiB)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if threads is not None:
        env["RAYON_RS_NUM_CPUS"] = str(threads)
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE, text=True
    )
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"measurement failed ({process.returncode}): {args}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux reports KiB
    result["cpu_seconds"] = usage.ru_utime + usage.ru_stime  # with its worker processes
    # CPU time over the process's whole wall time: how many cores it kept busy
    result["cores_used"] = result["cpu_seconds"] / (time.perf_counter() - started)
    return result


def interleaved(jobs: dict[str, tuple[str, object, int | None]], repeats: int) -> dict:
    """Run every job ``repeats`` times, rotating the order each round (load drifts hit all)."""
    runs: dict[str, list[dict]] = {name: [] for name in jobs}
    names = list(jobs)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            script, args_for, threads = jobs[name]
            runs[name].append(measure(script, args_for(round_index), threads))
    return {
        name: {
            "seconds": statistics.median(r["seconds"] for r in results),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in results),
            "cores_used": statistics.median(r["cores_used"] for r in results),
            "tokens": results[0]["tokens"],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
            "runs": results,
        }
        for name, results in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-prepare-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        files = stdlib_sources(int(args.mb * 1e6))
        one, ten = build_corpora(work, files)
        tokenizer = train_tokenizer(one, args.vocab, work / "tokenizer.json")
        size = sum(p.stat().st_size for p in one.iterdir())

        def job(name: str, corpus: Path, workers: str):
            return lambda i: [str(corpus), str(tokenizer), str(work / f"{name}-{i}"), workers]

        def peer(method: str):
            return lambda i: [str(one), str(tokenizer), str(work / f"{method}-{i}.bin"), method]

        load_before = os.getloadavg()
        timed = interleaved(
            {
                "peer": (PEER, peer("encode_batch"), 1),
                "peer_fast": (PEER, peer("encode_batch_fast"), 1),
                "w1": (PREPARE, job("w1", one, "1"), 1),
                "w2": (PREPARE, job("w2", one, "2"), None),
            },
            args.repeats,
        )
        x10 = interleaved({"x10": (PREPARE, job("x10", ten, "1"), 1)}, 1)["x10"]
        load_after = os.getloadavg()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    peer, peer_fast, w1, w2 = (timed[k] for k in ("peer", "peer_fast", "w1", "w2"))
    ratio = peer["seconds"] / w1["seconds"]
    ratio_fast = peer_fast["seconds"] / w1["seconds"]
    cpu_ratio = peer["cpu_seconds"] / w1["cpu_seconds"]
    cpu_ratio_fast = peer_fast["cpu_seconds"] / w1["cpu_seconds"]
    speedup = w1["seconds"] / w2["seconds"]
    memory = x10["peak_rss_mib"] / w1["peak_rss_mib"]
    result = {
        "benchmark": "prepare",
        "corpus": {"files": len(files), "bytes": size, "bytes_10x": size * 10},
        "tokenizer": {"kind": "byte-level BPE", "vocab": args.vocab},
        "cpus": os.cpu_count(),
        "load_average_before_after": [load_before, load_after],
        "peer_encode_batch_1thread": peer,
        "peer_encode_batch_fast_1thread": peer_fast,
        "prepare_1worker_1thread": w1,
        "prepare_2workers": w2,
        "prepare_10x_1worker_1thread": x10,
        "ratio_throughput_prepare_over_peer": ratio,
        "ratio_throughput_prepare_over_peer_fast": ratio_fast,
        "ratio_cpu_time_peer_over_prepare": cpu_ratio,
        "ratio_cpu_time_peer_fast_over_prepare": cpu_ratio_fast,
        "speedup_2workers_over_1": speedup,
        "peak_rss_ratio_10x_over_1x": memory,
        "targets": {"ratio_throughput": 0.9, "peak_rss_ratio_max": 1.2},
        "versions": {"python": platform.python_version()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    mb = size / 1e6
    print(f"corpus {len(files)} stdlib files, {mb:.1f} MB; BPE vocab {args.vocab}")
    print(
        f"peer encode_batch loop: {mb / peer['seconds']:.2f} MB/s "
        f"({peer['tokens'] / peer['seconds']:,.0f} tok/s)"
    )
    print(
        f"peer encode_batch_fast: {mb / peer_fast['seconds']:.2f} MB/s "
        f"({peer_fast['tokens'] / peer_fast['seconds']:,.0f} tok/s)"
    )
    print(
        f"prepare, 1 worker:      {mb / w1['seconds']:.2f} MB/s "
        f"({w1['tokens'] / w1['seconds']:,.0f} tok/s)  ratio {ratio:.2f} vs encode_batch "
        f"(target >= 0.9), {ratio_fast:.2f} vs encode_batch_fast"
    )
    print(
        f"CPU time (robust to a busy machine): ratio {cpu_ratio:.2f} vs encode_batch, "
        f"{cpu_ratio_fast:.2f} vs encode_batch_fast"
    )
    print(
        f"prepare, 2 workers:     {mb / w2['seconds']:.2f} MB/s  speed-up {speedup:.2f}x "
        f"on {os.cpu_count()} CPUs (kept {w2['cores_used']:.2f} cores busy; 1 worker "
        f"{w1['cores_used']:.2f})"
    )
    print(
        f"peak RSS: 1x {w1['peak_rss_mib']:.0f} MiB, 10x {x10['peak_rss_mib']:.0f} MiB "
        f"-> {memory:.2f}x (target <= 1.2x)"
    )
    print(f"load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
