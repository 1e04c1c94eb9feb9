"""eval.holdout: training never reads the held-out end; eval reads exactly it; node streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.data import build_node_dataloader, node_stream_seed, open_heldout
from speedtronic.train.evaluate import build_heldout

BLOCK = 8


def config(tmp_path, *, data=None, eval=None, vocab=256, **sections) -> SpeedtronicConfig:
    values = {
        "run": {"output_dir": str(tmp_path), "seed": 3},
        "model": {"vocab_size": vocab, "max_seq_len": BLOCK, "n_layer": 1, "n_head": 2},
        "data": {"micro_batch_size": 2, "target_batch_size": 2, **(data or {})},
        "eval": {"tokens": 10_000, **(eval or {})},
        **sections,
    }
    return SpeedtronicConfig.from_dict(values)


def epoch_tokens(loader, epochs: int = 3) -> set[int]:
    """Every token id in the inputs and labels of ``epochs`` passes over the loader."""
    seen: set[int] = set()
    for _ in range(epochs):
        for inputs, labels in loader:
            seen.update(inputs.flatten().tolist())
            seen.update(labels.flatten().tolist())
    return seen


def heldout_tokens(cfg) -> list[int]:
    held = build_heldout(cfg)
    assert held is not None
    tokens: list[int] = []
    for inputs, labels in held.batches:
        for row_in, row_lab in zip(inputs.tolist(), labels.tolist(), strict=True):
            tokens.extend(row_in[:1] + row_lab)
    return tokens


def test_text_holdout_is_the_last_bytes_and_training_never_reads_them(tmp_path):
    # 800 bytes of a-m, then 200 bytes of n-z: holdout 0.2 cuts exactly between them.
    head = bytes(97 + (i * 7) % 13 for i in range(800))
    tail = bytes(110 + (i * 5) % 13 for i in range(200))
    path = tmp_path / "corpus.txt"
    path.write_bytes(head + tail)
    cfg = config(tmp_path, data={"text_path": str(path)}, eval={"holdout": 0.2})
    seen = epoch_tokens(build_node_dataloader(cfg))
    assert seen and max(seen) < 110  # no byte of the tail
    assert len(seen) == 13  # and the head is read
    held = heldout_tokens(cfg)
    assert held == list(tail[: len(held)])  # windows in order from the cut
    assert len(held) == (200 // (BLOCK + 1)) * (BLOCK + 1)
    # Without holdout, training reads the tail too.
    plain = config(tmp_path, data={"text_path": str(path)})
    assert max(epoch_tokens(build_node_dataloader(plain))) >= 110
    assert build_heldout(plain) is None


@pytest.mark.parametrize("sampling", ["random", "sequential"])
def test_token_file_holdout_is_the_last_tokens(tmp_path, sampling):
    tokens = np.arange(1000, dtype=np.uint16)  # token value == position
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    data = {"token_path": str(path), "sampling": sampling}
    cfg = config(tmp_path, data=data, eval={"holdout": 0.1}, vocab=1000)
    seen = epoch_tokens(build_node_dataloader(cfg), epochs=5)
    assert 900 - (BLOCK + 1) <= max(seen) <= 899  # position 900 onwards is never read
    held = heldout_tokens(cfg)
    assert held[0] == 900 and held == list(range(900, 900 + len(held)))
    assert len(held) == 11 * (BLOCK + 1)  # 100 tokens hold 11 whole windows


class Rows(Dataset):
    """A map-style dataset whose row ``i`` carries only the token ``i``."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        row = torch.full((BLOCK,), i, dtype=torch.long)
        return {"input_ids": row, "labels": row}


class Stream(IterableDataset):
    def __iter__(self):
        yield {"input_ids": torch.zeros(BLOCK, dtype=torch.long), "labels": torch.zeros(BLOCK)}


@pytest.mark.parametrize("kind", ["object", "rows_file", "records_file", "stream_file"])
def test_dataset_holdout_is_the_last_samples(tmp_path, kind):
    if kind == "object":
        spec, last = Rows(), 39
    elif kind == "rows_file":
        spec, last = str(tmp_path / "rows.pt"), 39
        torch.save(torch.arange(40)[:, None].repeat(1, BLOCK + 1), spec)
    elif kind == "records_file":
        spec, last = str(tmp_path / "records.pt"), 39
        rows = torch.arange(40)[:, None].repeat(1, BLOCK)
        torch.save({"input_ids": rows, "labels": rows}, spec)
    else:  # a 1-D token stream: split by tokens
        spec, last = str(tmp_path / "stream.pt"), 399
        torch.save(torch.arange(400), spec)
    cfg = config(tmp_path, data={"dataset": spec}, eval={"holdout": 0.25}, vocab=400)
    seen = epoch_tokens(build_node_dataloader(cfg))
    cut = int((last + 1) * 0.75)
    assert max(seen) < cut
    held = heldout_tokens(cfg)
    assert min(held) >= cut and max(held) == (last if kind != "stream_file" else max(held))
    assert held[0] == cut


def test_iterable_dataset_cannot_be_held_out(tmp_path):
    cfg = config(tmp_path, data={"dataset": Stream()}, eval={"holdout": 0.1})
    with pytest.raises(ConfigError, match=r"eval\.holdout: data\.dataset is an iterable"):
        build_node_dataloader(cfg)
    with pytest.raises(ConfigError, match=r"eval\.holdout: data\.dataset is an iterable"):
        build_heldout(cfg)


@pytest.mark.parametrize("kind", ["markov", "uniform"])
def test_synthetic_holdout_is_a_disjoint_sample_domain(tmp_path, kind):
    data = {"synthetic": kind, "num_tokens": 200, "block_size": 32}  # windows never repeat
    cfg = config(tmp_path, data=data, eval={"holdout": 0.1, "batch_size": 4})
    train = {tuple(x) for inputs, _ in build_node_dataloader(cfg) for x in inputs.tolist()}
    held = build_heldout(cfg)
    rows = [tuple(x) for inputs, _ in held.batches for x in inputs.tolist()]
    assert len(rows) == 20 and held.tokens == 20 * 32  # ceil(0.1 * 200) samples
    assert len(train) == 200 and not train & set(rows)
    assert (held.floor is not None) == (kind == "markov")


def test_heldout_tokens_round_up_to_whole_windows_and_report_shortfall(tmp_path):
    cfg = config(tmp_path, data={"num_tokens": 100}, eval={"holdout": 0.1, "tokens": 20})
    held = build_heldout(cfg)
    assert held.tokens == 24 and held.requested == 20  # three windows of 8 targets
    assert [tuple(b[0].shape) for b in held.batches] == [(2, BLOCK), (1, BLOCK)]
    short = build_heldout(config(tmp_path, data={"num_tokens": 100}, eval={"holdout": 0.1}))
    assert short.tokens == 10 * BLOCK < short.requested  # the whole region, no more


def test_heldout_files_and_their_errors(tmp_path):
    text = tmp_path / "val.txt"
    text.write_text("held out text " * 10)
    held = build_heldout(config(tmp_path, eval={"text_path": str(text)}))
    assert bytes(held.batches[0][0][0].tolist()) == b"held out"
    tokens = tmp_path / "val.bin"
    np.arange(50, dtype=np.uint32).tofile(tokens)
    cfg = config(tmp_path, data={"token_dtype": "uint32"}, eval={"token_path": str(tokens)})
    assert build_heldout(cfg).batches[0][0][0].tolist() == list(range(BLOCK))
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ConfigError, match=r"eval\.text_path: the held-out text .* shorter"):
        build_heldout(config(tmp_path, eval={"text_path": str(short)}))
    with pytest.raises(ConfigError, match=r"eval\.token_path: file not found"):
        build_heldout(config(tmp_path, eval={"token_path": str(tmp_path / "nope.bin")}))
    wide = tmp_path / "wide.bin"
    np.full(50, 999, dtype=np.uint16).tofile(wide)
    with pytest.raises(ConfigError, match=r"eval\.token_path: .* token id 999"):
        build_heldout(config(tmp_path, eval={"token_path": str(wide)}))
    corpus = tmp_path / "corpus.bin"
    np.arange(100, dtype=np.uint16).tofile(corpus)
    tiny_tail = config(tmp_path, data={"token_path": str(corpus)}, eval={"holdout": 0.05})
    with pytest.raises(ConfigError, match=r"eval\.holdout: the held-out tokens .* fewer"):
        build_heldout(tiny_tail)
    big = config(tmp_path, data={"token_path": str(corpus)}, eval={"holdout": 0.95})
    with pytest.raises(ConfigError, match=r"data\.block_size: .* \(after eval\.holdout: 0\.95"):
        build_node_dataloader(big)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"holdout": 1.0}, r"eval\.holdout must be less than 1, got float 1.0"),
        ({"holdout": -0.1}, r"eval\.holdout must be greater than or equal to 0, got float -0.1"),
        ({"holdout": "much"}, r"eval\.holdout must be a number"),
        ({"every_steps": -1}, r"eval\.every_steps must be greater than or equal to 0"),
        ({"tokens": 0}, r"eval\.tokens must be greater than 0"),
        ({"batch_size": 0}, r"eval\.batch_size must be greater than 0"),
        ({"text_path": "a", "token_path": "b"}, r"eval\.text_path and eval\.token_path"),
        ({"holdout": 0.1, "text_path": "a"}, r"eval\.holdout cannot be combined"),
        ({"bogus": 1}, r"eval: unknown configuration keys: bogus"),
    ],
)
def test_eval_section_validation(section, message):
    with pytest.raises(ConfigError, match=message):
        SpeedtronicConfig.from_dict({"eval": section})


def test_eval_holdout_through_the_environment_layer(tmp_path):
    from speedtronic.config import resolve_config

    env = {"SPEEDTRONIC_EVAL__HOLDOUT": "0.05", "SPEEDTRONIC_EVAL__EVERY_STEPS": "0"}
    resolved = resolve_config("configs/smoke.yaml", environ=env, secrets_dir=str(tmp_path / "none"))
    assert resolved.config.eval.holdout == 0.05 and resolved.config.eval.every_steps == 0
    assert resolved.sources["eval.holdout"] == "env:SPEEDTRONIC_EVAL__HOLDOUT"
    with pytest.raises(ConfigError, match=r"eval\.holdout .*\(from env:SPEEDTRONIC_EVAL__HOLDOUT"):
        resolve_config(
            "configs/smoke.yaml",
            environ={"SPEEDTRONIC_EVAL__HOLDOUT": "1.5"},
            secrets_dir=str(tmp_path / "none"),
        )


def test_node_streams_differ_while_chain_and_heldout_agree(tmp_path):
    cfg = config(tmp_path, data={"num_tokens": 64, "shuffle": True}, eval={"holdout": 0.25})
    loaders = {node: build_node_dataloader(cfg, node) for node in ("w1", "w2", None)}
    firsts = {node: next(iter(loader))[0] for node, loader in loaders.items()}
    assert not torch.equal(firsts["w1"], firsts["w2"])
    assert not torch.equal(firsts["w1"], firsts[None])
    assert torch.equal(firsts["w1"], next(iter(build_node_dataloader(cfg, "w1")))[0])
    chains = [loader.dataset.chain for loader in loaders.values()]
    assert all(np.array_equal(c.successors, chains[0].successors) for c in chains)
    assert all(np.array_equal(c.probs, chains[0].probs) for c in chains)
    # The held-out set depends on data.seed only, never on the node.
    held = build_heldout(cfg)
    again = open_heldout(cfg.data, cfg.eval, block_size=BLOCK, vocab_size=256)
    first = next(iter(again.records()))
    assert torch.equal(held.batches[0][0][0], first["input_ids"])
    assert node_stream_seed(3, None) == 3 and node_stream_seed(3, "w1") != 3
    assert node_stream_seed(3, "w1") == node_stream_seed(3, "w1") != node_stream_seed(3, "w2")
