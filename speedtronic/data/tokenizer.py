"""Byte-level tokenizer used for ``data.text_path`` when no tokenizer is supplied."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["CharTokenizer", "encode_text"]


class CharTokenizer:
    """Byte-level tokenizer: each UTF-8 byte ``b`` becomes token ``b % vocab_size``.

    Despite the name it works on bytes, not characters; it is lossy when ``vocab_size < 256``
    and has no decode and no special tokens.
    """

    def __init__(self, vocab_size: int = 256) -> None:
        if int(vocab_size) <= 0:
            raise ValueError("vocab_size must be positive")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a Python list."""
        return [b % self.vocab_size for b in text.encode("utf-8")]

    __call__ = encode

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor (vectorised, same values as ``encode``)."""
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        if self.vocab_size < 256:
            data %= self.vocab_size
        return torch.from_numpy(data)


def encode_text(tokenizer: Any, text: str) -> torch.Tensor:
    """Tokenize ``text`` with any tokenizer (``encode`` method or callable) into int64 (N,)."""
    fast = getattr(tokenizer, "encode_tensor", None)
    if callable(fast):
        return fast(text)
    encode = getattr(tokenizer, "encode", None)
    ids = encode(text) if callable(encode) else tokenizer(text)
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return torch.tensor([int(i) for i in ids], dtype=torch.long)
