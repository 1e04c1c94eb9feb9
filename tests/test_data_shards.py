"""A folder written by ``speedtronic prepare`` as ``data.token_path`` / ``eval.token_path``."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizer_fixtures import train_bpe, write_corpus

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.data import TokenShards, build_node_dataloader
from speedtronic.data.prepare import prepare
from speedtronic.data.shards import open_prepared
from speedtronic.train.evaluate import build_heldout

MODEL = {"vocab_size": 320, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prepared")
    bpe = train_bpe(root / "tokenizer.json", vocab_size=320)
    corpus = write_corpus(root / "corpus", files=10, lines=60)
    prepare([str(corpus)], root / "tokens", tokenizer=str(bpe), holdout=0.2, shard_tokens=1000)
    return root / "tokens", bpe


def stream(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    parts = [np.fromfile(folder / e["file"], dtype=meta["dtype"]) for e in meta["shards"][split]]
    return np.concatenate(parts)


def config(folder: Path, bpe: Path, **sections) -> SpeedtronicConfig:
    values = {
        "model": dict(MODEL),
        "data": {"token_path": str(folder), "tokenizer": str(bpe), "micro_batch_size": 4},
    }
    values["data"]["target_batch_size"] = 4
    for name, fields in sections.items():
        values.setdefault(name, {}).update(fields)
    return SpeedtronicConfig.from_dict(values)


def test_token_shards_read_across_shard_boundaries(tmp_path):
    data = np.arange(2500, dtype=np.uint16)
    paths = []
    for i, (a, b) in enumerate([(0, 1000), (1000, 2000), (2000, 2500)]):
        paths.append(tmp_path / f"s{i}.bin")
        data[a:b].tofile(paths[-1])
    shards = TokenShards(paths, [1000, 1000, 500], "uint16")
    assert len(shards) == 2500 and shards[999] == 999 and shards[-1] == 2499
    for a, b in [(0, 2500), (990, 1010), (995, 2005), (1000, 1000), (2400, 3000)]:
        assert np.asarray(shards[a:b]).tolist() == data[a:b].tolist()
    view = shards[500:2200][100:1600]  # a view of a view
    assert np.asarray(view, dtype=np.int64).tolist() == data[600:2100].tolist()
    clone = pickle.loads(pickle.dumps(view))
    assert clone._maps == {} and np.asarray(clone).tolist() == data[600:2100].tolist()


def test_training_reads_every_shard_and_each_node_draws_its_own_windows(prepared):
    folder, bpe = prepared
    cfg = config(folder, bpe)
    train = stream(folder, "train")
    assert len(json.loads((folder / "meta.json").read_text())["shards"]["train"]) > 5
    starts = {}
    for node in ("worker-a", "worker-b", "worker-a"):
        loader = build_node_dataloader(cfg, node)
        batches = [next(iter(loader)) for _ in range(1)]
        inputs, labels = batches[0]
        rows = []
        for row, label in zip(inputs.tolist(), labels.tolist(), strict=True):
            window = np.lib.stride_tricks.sliding_window_view(train, 16)
            hits = np.flatnonzero((window == row).all(axis=1))
            assert hits.size, "every window is a slice of the training stream"
            assert train[hits[0] + 1 : hits[0] + 17].tolist() == label
            rows.append(int(hits[0]))
        starts.setdefault(node, []).append(rows)
    assert starts["worker-a"][0] == starts["worker-a"][1]  # deterministic per node
    assert starts["worker-a"][0] != starts["worker-b"][0]  # different nodes, different windows
    sequential = config(folder, bpe, data={"sampling": "sequential"})
    loader = build_node_dataloader(sequential, None)
    seen = torch.cat([b[0] for b in loader]).reshape(-1)
    span = (len(train) - 1) // 16 // 4 * 4 * 16  # whole windows, whole batches (drop_last)
    assert seen.tolist() == train[:span].tolist()  # all shards, in order, once per epoch


def test_eval_reads_the_held_out_shards_or_the_tail_of_training(prepared):
    folder, bpe = prepared
    held = stream(folder, "eval")
    heldout = build_heldout(config(folder, bpe, eval={"token_path": str(folder), "tokens": 64}))
    first = heldout.batches[0][0]
    assert first[0].tolist() == held[:16].tolist() and first[1].tolist() == held[17:33].tolist()
    train = stream(folder, "train")
    tail = build_heldout(config(folder, bpe, eval={"holdout": 0.1, "tokens": 64}))
    cut = int(len(train) * 0.9)
    assert tail.batches[0][0][0].tolist() == train[cut : cut + 16].tolist()


def test_a_folder_of_another_tokenizer_or_vocabulary_is_refused(prepared, tmp_path):
    folder, bpe = prepared
    with pytest.raises(ConfigError, match=r"not with data\.tokenizer"):
        build_node_dataloader(config(folder, bpe, data={"tokenizer": "bytes"}))
    other = train_bpe(tmp_path / "other.json", vocab_size=300)
    with pytest.raises(ConfigError, match=r"set data\.tokenizer to the tokenizer"):
        build_heldout(config(folder, other, eval={"token_path": str(folder)}))
    with pytest.raises(ConfigError, match=r"tokenized for 320 token ids but model\.vocab_size is"):
        open_prepared(folder, "train", "data.token_path", vocab_size=256)


def test_missing_shards_incomplete_folders_and_missing_holdout(prepared, tmp_path):
    folder, bpe = prepared
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "train_000002.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ConfigError, match=r"train_000002\.bin is missing or has 2 bytes"):
        build_node_dataloader(config(copy, bpe))
    (copy / "meta.json").unlink()
    with pytest.raises(ConfigError, match="is a directory, expected a token file or a folder"):
        config(copy, bpe)
    bare = tmp_path / "bare"
    prepare([str(write_corpus(tmp_path / "c", files=2))], bare, tokenizer=str(bpe))
    with pytest.raises(ConfigError, match="has no eval shards \\(prepared without --holdout\\)"):
        build_heldout(config(bare, bpe, eval={"token_path": str(bare)}))
