"""Small real tokenizers for data tests, trained in the test with ``tokenizers`` (no network).

Import explicitly: ``from tokenizer_fixtures import CORPUS, train_bpe, write_corpus``.
"""

from __future__ import annotations

import json
from pathlib import Path

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine and the early bird catches the worm",
    "pack my box with five dozen liquor jugs",
    "sphinx of black quartz judge my vow",
    "how vexingly quick daft zebras jump",
    "the five boxing wizards jump quickly",
]


def corpus_text(lines: int, seed: int = 0) -> str:
    """``lines`` lines of the sentences above, in a fixed shuffled order (no leading spaces)."""
    import random

    rng = random.Random(seed)
    return "".join(f"{rng.choice(SENTENCES)} {i}\n" for i in range(lines))


def write_corpus(folder: Path, files: int = 12, lines: int = 40) -> Path:
    """A folder of ``files`` small text files (``doc_000.txt`` ...); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"doc_{i:03d}.txt").write_text(corpus_text(lines, seed=i), encoding="utf-8")
    return folder


def train_bpe(
    path: Path, vocab_size: int = 300, *, eos: str | None = "<|endoftext|>", texts=None
) -> Path:
    """Train a byte-level BPE ``tokenizer.json`` at ``path`` (``eos``: its special token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos] if eos else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts or [corpus_text(200, seed=s) for s in range(5)], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def word_level(path: Path, vocab_size: int, eos: str = "<|endoftext|>") -> Path:
    """A WordLevel ``tokenizer.json`` with ``vocab_size`` ids (fast to build at any size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"[UNK]": vocab_size - 2, eos: vocab_size - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([eos])
    tokenizer.save(str(path))
    return path


def vocab_of(path: Path) -> int:
    """Highest id + 1 of a tokenizer.json (what validation compares with model.vocab_size)."""
    document = json.loads(Path(path).read_text())
    ids = list(document["model"]["vocab"].values()) + [t["id"] for t in document["added_tokens"]]
    return max(ids) + 1
