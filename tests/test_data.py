"""Data: synthetic, text streaming, collate, resumable loader positions."""

from __future__ import annotations

import builtins

import pytest
import torch

from speedtronic.config import DataConfig
from speedtronic.data import (
    CharTokenizer,
    SyntheticTokenDataset,
    TextFileTokenDataset,
    build_dataloader,
    collate_batch,
    collate_causal,
    data_state_dict,
    infinite_batches,
    load_data_state_dict,
)
from speedtronic.data import datasets as datasets_module


def data_config(**kwargs) -> DataConfig:
    """A ``data`` section of ``micro_batch_size`` (2) samples per step and per micro-batch,
    ``block_size`` 8 and ``seed`` 7 unless given."""
    micro = kwargs.pop("micro_batch_size", 2)
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("seed", 7)
    return DataConfig(micro_batch_size=micro, target_batch_size=micro, **kwargs)


def take(loader, n: int) -> list:
    batches = infinite_batches(loader)
    return [next(batches) for _ in range(n)]


def resumed_after(cfg: DataConfig, consumed: int):
    """A new loader on ``cfg`` (vocabulary 256) that took over the saved position of one that
    had handed out ``consumed`` batches."""
    loader = build_dataloader(cfg, vocab_size=256)
    stream = infinite_batches(loader)
    for _ in range(consumed):
        next(stream)
    resumed = build_dataloader(cfg, vocab_size=256)
    load_data_state_dict(resumed, data_state_dict(loader))
    return resumed


def test_char_tokenizer_is_byte_level():
    tok = CharTokenizer(vocab_size=256)
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok("a") == [97]
    assert CharTokenizer(16).encode_tensor("aé").tolist() == [97 % 16, 0xC3 % 16, 0xA9 % 16]
    with pytest.raises(ValueError, match="positive"):
        CharTokenizer(0)


def test_synthetic_dataset_is_deterministic_and_shifted():
    ds = SyntheticTokenDataset(num_samples=4, block_size=8, vocab_size=16, seed=3)
    again = SyntheticTokenDataset(num_samples=4, block_size=8, vocab_size=16, seed=3)
    for i in (3, 0, 2):
        a, b = ds[i], again[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (8,)
        assert torch.equal(a["input_ids"][1:], a["labels"][:-1])
    assert torch.equal(ds[-1]["labels"], ds[3]["labels"])
    assert not torch.equal(ds[0]["input_ids"], ds[1]["input_ids"])
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(ValueError, match="positive"):
        SyntheticTokenDataset(num_samples=0)


def test_synthetic_loader_yields_int64_tuples_and_shuffles_reproducibly():
    cfg = data_config(num_tokens=20, shuffle=True, vocab_size=16)
    first = take(build_dataloader(cfg), 4)
    second = take(build_dataloader(cfg), 4)
    inputs, labels = first[0]
    assert inputs.shape == labels.shape == (2, 8) and inputs.dtype == labels.dtype == torch.int64
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
    plain = take(build_dataloader(data_config(num_tokens=20, vocab_size=16)), 4)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, plain, strict=True))
    assert build_dataloader(cfg, vocab_size=4).dataset.vocab_size == 4


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_position_reproduces_the_uninterrupted_stream(shuffle):
    cfg = data_config(num_tokens=10, shuffle=shuffle, vocab_size=16)  # 5 batches per epoch
    reference = take(build_dataloader(cfg), 12)
    loader = build_dataloader(cfg)
    stream = infinite_batches(loader)
    for _ in range(7):
        next(stream)
    state = data_state_dict(loader)
    assert state == {"epoch": 1, "batches": 2, "batch_size": 2}
    resumed = build_dataloader(cfg)
    assert load_data_state_dict(resumed, state)
    rest = take(resumed, 5)
    for want, got in zip(reference[7:], rest, strict=True):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert not load_data_state_dict(resumed, None)
    assert data_state_dict([1, 2]) is None


@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_resume_exactly_at_an_epoch_boundary(tmp_path, source):
    if source == "text":
        cfg = data_config(text_path=str(write_text(tmp_path, "abcdefghi" * 10)))  # 5 batches
    else:
        cfg = data_config(num_tokens=10, shuffle=True, vocab_size=16)  # 5 batches
    reference = take(build_dataloader(cfg, vocab_size=256), 7)
    resumed = resumed_after(cfg, 5)
    assert [b[0].tolist() for b in take(resumed, 2)] == [b[0].tolist() for b in reference[5:]]


def test_resume_with_workers_counts_consumed_not_prefetched_batches():
    cfg = data_config(num_tokens=12, shuffle=True, vocab_size=16, num_workers=2)
    loader = build_dataloader(cfg)
    assert loader.persistent_workers and loader.prefetch_factor == 2
    stream = infinite_batches(loader)
    seen = [next(stream) for _ in range(4)]
    state = data_state_dict(loader)
    assert state["batches"] == 4
    expected = next(stream)
    resumed = build_dataloader(data_config(num_tokens=12, shuffle=True, vocab_size=16))
    load_data_state_dict(resumed, state)
    assert torch.equal(next(iter(resumed))[0], expected[0])
    assert len({tuple(b[0].flatten().tolist()) for b in seen}) == 4


def write_text(tmp_path, text: str, name: str = "train.txt"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_text_stream_pinned_example(tmp_path):
    path = write_text(tmp_path, "abcdefghijklmnopqrstuvwxyz")
    blocks = list(TextFileTokenDataset(path, block_size=4))
    assert len(blocks) == 5
    assert all(b["input_ids"].shape == (4,) for b in blocks)
    assert bytes(blocks[0]["input_ids"].tolist()) == b"abcd"
    assert bytes(blocks[0]["labels"].tolist()) == b"bcde"
    assert bytes(blocks[1]["input_ids"].tolist()) == b"fghi"


def test_text_stream_reads_in_bounded_chunks(tmp_path, monkeypatch):
    text = "".join(chr(97 + (i * 7) % 26) for i in range(5000)) + "\r\nend é\n"
    path = write_text(tmp_path, text)
    reads: list[int] = []
    real_open = builtins.open

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def read(self, size=-1):
            reads.append(size)
            return self.handle.read(size)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(
        datasets_module, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False
    )
    blocks = list(TextFileTokenDataset(path, block_size=16, chunk_chars=100))
    assert reads and all(0 < size <= 100 for size in reads)  # never a whole-file read()
    assert len(reads) > 50
    tokens = torch.cat([torch.cat((b["input_ids"], b["labels"][-1:])) for b in blocks])
    expected = list(text.replace("\r\n", "\n").encode("utf-8"))
    assert tokens.tolist() == expected[: len(tokens)]
    assert len(expected) - len(tokens) < 17


def test_text_stream_shards_across_two_workers_without_duplicates(tmp_path):
    text = "".join(f"line {i:04d} of the corpus\n" for i in range(400))
    path = write_text(tmp_path, text)

    def windows(workers: int, micro: int) -> list[tuple[int, ...]]:
        cfg = data_config(
            text_path=str(path), block_size=32, micro_batch_size=micro, num_workers=workers
        )
        loader = build_dataloader(cfg, vocab_size=256)
        return [tuple(row.tolist()) for inputs, _ in loader for row in inputs]

    for micro in (1, 3):
        single, sharded = windows(0, micro), windows(2, micro)
        assert len(sharded) == len(set(sharded)) == len(single) > 100
        assert sharded == single  # same batches, same order, as without workers


def test_text_resume_fast_forwards_the_stream(tmp_path):
    path = write_text(tmp_path, "0123456789" * 50)
    cfg = data_config(text_path=str(path), block_size=8)
    reference = take(build_dataloader(cfg, vocab_size=256), 40)
    resumed = resumed_after(cfg, 30)
    for want, got in zip(reference[30:], take(resumed, 10), strict=True):
        assert torch.equal(want[0], got[0])


def test_collate_pads_only_ragged_batches():
    a = {"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([2, 3, 4])}
    b = {"input_ids": torch.tensor([5]), "labels": torch.tensor([6])}
    inputs, labels = collate_causal([a, a])
    assert inputs.shape == (2, 3) and labels.dtype == torch.int64
    padded = collate_causal([a, b])
    assert padded["input_ids"].tolist() == [[1, 2, 3], [5, 0, 0]]
    assert padded["labels"].tolist() == [[2, 3, 4], [6, -100, -100]]
    assert padded["attention_mask"].tolist() == [[True] * 3, [True, False, False]]
    x, names = collate_batch([(torch.zeros(2), "p"), (torch.ones(2), "q")])
    assert x.shape == (2, 2) and names == ["p", "q"]
    assert collate_batch([torch.zeros(3), torch.zeros(3)]).shape == (2, 3)
    with pytest.raises(ValueError, match="empty batch"):
        collate_batch([])
    with pytest.raises(ValueError, match="same number of fields"):
        collate_batch([(1, 2), (1,)])


def test_infinite_batches_loops_and_rejects_empty_loaders():
    stream = infinite_batches([1, 2])
    assert [next(stream) for _ in range(5)] == [1, 2, 1, 2, 1]
    with pytest.raises(RuntimeError, match="no batches"):
        next(infinite_batches([]))


def test_explicit_dataset_argument_wins():
    ds = SyntheticTokenDataset(num_samples=4, block_size=4, vocab_size=8)
    loader = build_dataloader(data_config(block_size=8), dataset=ds)
    assert loader.dataset is ds and next(iter(loader))[0].shape == (2, 4)
