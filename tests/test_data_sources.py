"""Data sources: token files, serialized datasets and every bad-input ConfigError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_data import data_config as small_data_config
from test_data import resumed_after
from torch.utils.data import Dataset

from speedtronic.config import ConfigError, DataConfig
from speedtronic.data import (
    TokenFileDataset,
    build_dataloader,
    infinite_batches,
)


def data_config(**kwargs) -> DataConfig:
    kwargs.setdefault("seed", 5)
    return small_data_config(**kwargs)


def write_tokens(tmp_path, tokens: np.ndarray, suffix: str):
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".npy":
        np.save(path, tokens)
    else:
        tokens.tofile(path)
    return path


class ListDataset(Dataset):
    """A pickled Dataset object (loaded only with data.allow_pickle)."""

    def __init__(self, n: int):
        self.items = [torch.arange(5) + i for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i][:-1], "labels": self.items[i][1:]}


@pytest.mark.parametrize(
    ("suffix", "dtype"),
    [(".bin", "uint16"), (".bin", "uint32"), (".npy", "uint16"), (".npy", "uint32")],
)
def test_token_file_sequential_windows(tmp_path, suffix, dtype):
    tokens = (np.arange(1000) % 500).astype(dtype)
    path = write_tokens(tmp_path, tokens, suffix)
    cfg = data_config(token_path=str(path), token_dtype=dtype, sampling="sequential")
    loader = build_dataloader(cfg, vocab_size=500)
    assert isinstance(loader.dataset, TokenFileDataset)
    inputs, labels = next(iter(loader))
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.tolist() == [list(range(0, 8)), list(range(8, 16))]
    assert labels.tolist() == [list(range(1, 9)), list(range(9, 17))]
    assert len(loader) == (1000 - 1) // 8 // 2


def test_token_file_random_windows_are_seeded_contiguous_slices(tmp_path):
    tokens = np.arange(5000, dtype=np.uint32)
    path = write_tokens(tmp_path, tokens, ".npy")

    def first_batches(seed: int, workers: int = 0) -> list[torch.Tensor]:
        cfg = data_config(token_path=str(path), seed=seed, num_workers=workers)
        stream = infinite_batches(build_dataloader(cfg, vocab_size=5000))
        return [next(stream)[0] for _ in range(3)]

    a, b, c = first_batches(1), first_batches(1), first_batches(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    starts = a[0][:, 0]
    assert torch.equal(a[0], starts[:, None] + torch.arange(8))  # contiguous windows
    two_workers = first_batches(1, workers=2)
    assert all(torch.equal(x, y) for x, y in zip(a, two_workers, strict=True))


def test_token_file_resume_across_epochs(tmp_path):
    path = write_tokens(tmp_path, np.arange(200, dtype=np.uint16), ".bin")
    cfg = data_config(token_path=str(path))  # 24 windows -> 12 batches per epoch
    ref_stream = infinite_batches(build_dataloader(cfg, vocab_size=256))
    reference = [next(ref_stream) for _ in range(30)]
    resumed = resumed_after(cfg, 17)
    again = infinite_batches(resumed)
    for want in reference[17:]:
        assert torch.equal(next(again)[0], want[0])
    assert not torch.equal(reference[0][0], reference[12][0])  # a new epoch draws new windows


def test_token_file_dataset_pickles_as_a_path(tmp_path):
    import pickle

    path = write_tokens(tmp_path, np.arange(100, dtype=np.uint16), ".bin")
    ds = TokenFileDataset(path, block_size=4)
    assert ds[10]["input_ids"].tolist() == [10, 11, 12, 13]
    assert len(pickle.dumps(ds)) < 1000


def test_serialized_tensor_datasets(tmp_path):
    stream = tmp_path / "stream.pt"
    torch.save(torch.arange(100) % 50, stream)
    inputs, labels = next(iter(build_dataloader(data_config(dataset=str(stream)), vocab_size=50)))
    assert torch.equal(labels, (inputs + 1) % 50) and labels.shape == (2, 8)
    rows = tmp_path / "rows.pt"
    torch.save(torch.arange(40).view(4, 10), rows)
    inputs, labels = next(iter(build_dataloader(data_config(dataset=str(rows)), vocab_size=64)))
    assert inputs.tolist()[0] == list(range(8)) and labels.tolist()[0] == list(range(1, 9))
    records = tmp_path / "records.pt"
    torch.save(
        {"input_ids": torch.zeros(6, 8, dtype=torch.long), "labels": torch.ones(6, 8)}, records
    )
    inputs, labels = next(iter(build_dataloader(data_config(dataset=str(records)), vocab_size=8)))
    assert inputs.shape == (2, 8) and labels.dtype == torch.int64


def test_pickled_dataset_requires_opt_in(tmp_path):
    path = tmp_path / "ds.pt"
    torch.save(ListDataset(6), path)
    with pytest.raises(ConfigError, match=r"data\.dataset: .*set data\.allow_pickle: true"):
        build_dataloader(data_config(dataset=str(path), block_size=4))
    loader = build_dataloader(data_config(dataset=str(path), block_size=4, allow_pickle=True))
    inputs, _ = next(iter(loader))
    assert inputs.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]]


def bad(tmp_path, vocab: int = 256, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        build_dataloader(data_config(**kwargs), vocab_size=vocab)
    return str(info.value)


def test_text_path_errors(tmp_path):
    assert "data.text_path: file not found" in bad(tmp_path, text_path=str(tmp_path / "x.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "data.text_path: file is empty" in bad(tmp_path, text_path=str(empty))
    short = tmp_path / "short.txt"
    short.write_text("hello")
    message = bad(tmp_path, text_path=str(short), block_size=64)
    assert (
        message.startswith("data.block_size: 64 is larger than the data") and "5 tokens" in message
    )
    assert "not a regular file" in bad(tmp_path, text_path=str(tmp_path))


def test_token_file_errors(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    assert "not a multiple of 2" in bad(tmp_path, token_path=str(odd))
    four = tmp_path / "four.bin"
    np.arange(402, dtype=np.uint16).tofile(four)  # 804 bytes: not uint32-aligned
    assert "data.token_dtype" in bad(tmp_path, token_path=str(four), token_dtype="uint32")
    big = write_tokens(tmp_path, np.full(100, 9000, dtype=np.uint16), ".bin")
    message = bad(tmp_path, token_path=str(big))
    assert "token id 9000" in message and "model.vocab_size" in message
    few = write_tokens(tmp_path, np.arange(5, dtype=np.uint16), ".npy")
    assert "data.block_size: 8 is larger than the data" in bad(tmp_path, token_path=str(few))
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.arange(100, dtype=np.int64))
    assert "uint16 or uint32" in bad(tmp_path, token_path=str(wrong))
    matrix = tmp_path / "matrix.npy"
    np.save(matrix, np.zeros((10, 10), dtype=np.uint16))
    assert "1-D" in bad(tmp_path, token_path=str(matrix))
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not numpy at all")
    assert "not a readable .npy" in bad(tmp_path, token_path=str(junk))
    other = tmp_path / "tokens.txt"
    other.write_bytes(b"\x00" * 100)
    assert "must end in .bin" in bad(tmp_path, token_path=str(other))
    assert "data.token_path: file not found" in bad(tmp_path, token_path=str(tmp_path / "n.bin"))


def test_dataset_path_errors(tmp_path):
    assert "data.dataset: file not found" in bad(tmp_path, dataset=str(tmp_path / "none.pt"))
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x00garbage")
    assert "data.dataset: cannot load" in bad(tmp_path, dataset=str(corrupt))
    floats = tmp_path / "floats.pt"
    torch.save(torch.randn(100), floats)
    assert "float32 tensor" in bad(tmp_path, dataset=str(floats))
    short = tmp_path / "short.pt"
    torch.save(torch.arange(5), short)
    assert "is larger than the data" in bad(tmp_path, dataset=str(short))
    out_of_vocab = tmp_path / "oov.pt"
    torch.save(torch.arange(100), out_of_vocab)
    assert "token id 99" in bad(tmp_path, dataset=str(out_of_vocab), vocab=50)


def test_a_dataset_object_that_is_no_torch_dataset_is_named():
    """An object with ``__getitem__`` passes the config's check but is no torch Dataset: the
    training source and the held-out split both refuse it in one line (was a TypeError)."""

    class Rows:
        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.arange(9)

        def __len__(self) -> int:
            return 4

    message = "data.dataset must be a path or a torch Dataset, got a Rows"
    assert bad(None, dataset=Rows()) == message
    from speedtronic.config import EvalConfig
    from speedtronic.data.heldout import open_heldout

    with pytest.raises(ConfigError, match=message):
        open_heldout(
            data_config(dataset=Rows()), EvalConfig(holdout=0.25), block_size=8, vocab_size=64
        )


def test_no_source_with_synthetic_off():
    with pytest.raises(ConfigError, match=r"data\.synthetic: false"):
        build_dataloader(data_config(synthetic=False))
